"""The ``ucp`` command: argparse verbs mapped onto the Python API, nothing more.

Expected failures (UcpError) print one line to stderr and exit non-zero; ``--debug`` keeps the
traceback. Anything else is a bug and keeps its traceback. Every verb that writes checks its output
with ``ucp.io.guard`` first (never over an input, never over a folder ucp did not write, room on
the disk) and runs inside ``ucp.io.signals.stop_on_signals`` (SIGTERM and SIGHUP act like Ctrl-C).

What lives where: ``parser`` (build_parser, every verb's flags, FLAVOUR_NAMES, DCP_OPTIMIZER_NAMES),
``output`` (what writing verbs share: output policy, the guarded write, the result line), ``restore``
(restore and reshard), ``verbs`` (to-universal, inspect, verify, diff, export, migrate, demo), and
``main`` here.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence

from ucp import shared_folder
from ucp.cli.output import say
from ucp.cli.parser import DCP_OPTIMIZER_NAMES, FLAVOUR_NAMES, build_parser
from ucp.errors import Stopped, UcpError
from ucp.io.signals import held_signals, raise_if_stopped, stop_on_signals
from ucp.io.timing import phase

__all__ = ["DCP_OPTIMIZER_NAMES", "FLAVOUR_NAMES", "build_parser", "main"]

logger = logging.getLogger("ucp")


def main(argv: Sequence[str] | None = None, *, last: bool = False) -> int:
    """Run one command; its exit code. ``last``: the process only exits after this call (``ucp.__main__``),
    so once the command has ended its stop signals are ignored rather than given back to the caller's handlers."""
    clash = shared_folder()
    if clash is not None:
        say(f"ucp: warning: {clash}")
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING
    if args.quiet and not (args.debug or args.verbose):
        level = logging.ERROR
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    with held_signals() as held:  # every verb needs torch: import it where a Ctrl-C cannot break the import
        import torch  # noqa: F401
    # torch's hundreds of thousands of objects live as long as the process: keep the collector's full
    # passes (one lands in most runs, ~70 ms) off them
    gc.freeze()
    if held:
        name = signal.Signals(held[0]).name
        say(f"ucp: interrupted by {name} while starting; nothing was written")
        return 128 + held[0]
    try:
        if getattr(args, "workers", None):  # one budget of threads: parameters in parallel, and a big one's ranges
            from ucp.io.span_copy import set_copy_threads

            set_copy_threads(args.workers)
        with stop_on_signals(then_ignore=last), phase(f"ucp {args.verb} in all"):
            code = args.func(args)
            raise_if_stopped()  # a library swallowed the signal's exception: the command still ends as stopped
            return code
    except UcpError as err:
        if args.debug:
            raise
        say(f"ucp: error: {err}")
        return err.exit_code
    except BrokenPipeError:  # `ucp inspect CKPT | head`: the reader left; say nothing more, as `cat` would
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's final flush of stdout must not fail again
        return 141  # 128 + SIGPIPE, what a shell reports for a command a pipe closed
    except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM, SIGHUP (ucp.errors.Stopped): staging already removed
        name = err.name if isinstance(err, Stopped) else "Ctrl-C"
        say(f"ucp: interrupted by {name}; nothing was left half-written")
        return err.exit_code if isinstance(err, Stopped) else 130
