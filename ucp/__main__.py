"""``python -m ucp``: the same as the ``ucp`` command."""

try:  # first: a Ctrl-C while even ``signal`` imports (its enums take a while) is one line too
    import os
    import signal
    import sys

    def _early_stop(signum: int, frame: object) -> None:
        """Ctrl-C (or SIGTERM/SIGHUP) before the CLI takes over: one line, no traceback, nothing written."""
        os.write(2, f"ucp: interrupted by {signal.Signals(signum).name} while starting; nothing was written\n".encode())
        os._exit(128 + signum)

    for _signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(_signum, _early_stop)
except KeyboardInterrupt:
    __import__("os").write(2, b"ucp: interrupted by SIGINT while starting; nothing was written\n")
    raise SystemExit(130) from None

from ucp.cli import main  # noqa: E402  (after the handlers: its imports take a while)

sys.exit(main())
