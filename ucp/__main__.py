"""``python -m ucp``: the same as the ``ucp`` command."""

import sys

from ucp.cli import main

sys.exit(main())
