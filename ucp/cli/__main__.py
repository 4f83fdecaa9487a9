"""``python -m ucp.cli``: the same as ``python -m ucp`` (as when the CLI was one module)."""

import sys

from ucp.cli import main

sys.exit(main())
