"""``python -m ucp.cli``: the same as ``python -m ucp`` (as when the CLI was one module)."""

from ucp.__main__ import run

run()
