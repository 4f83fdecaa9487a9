"""What every writing verb shares: the user's output policy, writing OUT inside the guard, the size
estimates its space check uses, and the result line (or --json object)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ucp.errors import UcpError

if TYPE_CHECKING:
    from ucp.io.guard import OutputPolicy
    from ucp.model.records import Facts, Reader

__all__ = ["done", "output", "output_policy", "say", "universal_size", "weights"]


def say(line: str) -> None:
    """One line to stderr in one write. The processes of a ``--distributed`` run share their launcher's stderr, and
    ``print`` writes the text and its newline apart: with PYTHONUNBUFFERED two processes' lines ran into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def output_policy(args: argparse.Namespace) -> OutputPolicy:
    """What the user allowed for an existing OUT and the space check."""
    from ucp.io.guard import OutputPolicy

    if args.overwrite_foreign and not args.overwrite:
        raise UcpError("--overwrite-foreign widens --overwrite to folders ucp did not write; pass both")
    return OutputPolicy(overwrite=args.overwrite, foreign=args.overwrite_foreign, space_check=not args.no_space_check)


@contextlib.contextmanager
def output(
    args: argparse.Namespace, src: str, open_source: Callable[[], Reader], size: Callable[[Facts], int]
) -> Iterator[Reader]:
    """The one way a verb writes ``args.out`` from ``src``: OUT checked against the input and the
    user's flags (ucp.io.guard.check_output) before the input is opened, then the write inside
    ucp.io.guard.writing (space check from ``size`` of the input's facts; faults as one line)."""
    from ucp.io.guard import check_output, writing

    policy = output_policy(args)
    check_output(args.out, {"source": src}, policy)
    with open_source() as reader, writing({Path(args.out): size(reader.facts)}, policy):
        yield reader


def weights(args: argparse.Namespace) -> Callable[[Facts], int]:
    """The size estimate of an output holding the weights at ``--dtype`` (a lower bound of any restore)."""
    from ucp.io.guard import weight_bytes

    return lambda facts: weight_bytes(facts, getattr(args, "dtype", None))


def universal_size(facts: Facts) -> int:
    """The size estimate of a universal directory of ``facts``."""
    from ucp.io.guard import universal_bytes

    return universal_bytes(facts)


def done(args: argparse.Namespace, summary: str, notes: Sequence[str] = (), **data: Any) -> int:
    """A writing verb's result: the summary line on stdout (notes on stderr), or with --json one object
    on stdout (``summary``, ``notes``, ``out`` and the verb's own fields); --quiet prints nothing."""
    if getattr(args, "json", False):
        print(json.dumps({"verb": args.verb, "out": str(args.out), "summary": summary, "notes": list(notes), **data}))
    elif not args.quiet:
        for note in notes:
            say(f"note: {note}")
        print(summary)
    return 0
