"""``python -m ucp`` and the ``ucp`` command: the process's one entry, :func:`run`."""

try:  # first: a Ctrl-C while even ``signal`` imports (its enums take a while) is one line too
    import os
    import signal
    import sys
    from typing import NoReturn

    _STOP = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def _early_stop(signum: int, frame: object) -> None:
        """Ctrl-C (or SIGTERM/SIGHUP) before the CLI takes over: one line, no traceback, nothing written."""
        os.write(2, f"ucp: interrupted by {signal.Signals(signum).name} while starting; nothing was written\n".encode())
        os._exit(128 + signum)

except KeyboardInterrupt:
    __import__("os").write(2, b"ucp: interrupted by SIGINT while starting; nothing was written\n")
    raise SystemExit(130) from None


def run() -> NoReturn:
    """Run the CLI as this process's whole work, and exit with its code.

    Until the CLI takes over, a stop signal ends the process with one line. Once the command has
    ended, its output is published or removed and the process only exits, so a stop signal is
    ignored: otherwise the handler above would claim nothing was written, or Python, which gives
    a signal its default action while it shuts down, would die of it after the output was published.
    """
    for signum in _STOP:
        signal.signal(signum, _early_stop)
    from ucp.cli import main  # after the handlers: its imports take a while

    code = main(last=True)
    for signum in _STOP:
        signal.signal(signum, signal.SIG_IGN)
    sys.exit(code)


if __name__ == "__main__":
    run()
