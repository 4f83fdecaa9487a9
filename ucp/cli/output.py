"""What every writing verb shares: the user's output policy (which the API's writers apply: ``ucp.io.guard``)
and the result line (or --json object)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ucp.errors import UcpError

if TYPE_CHECKING:
    from ucp.io.guard import OutputPolicy

__all__ = ["done", "output_policy", "say"]


def say(line: str) -> None:
    """One line to stderr in one write. The processes of a ``--distributed`` run share their launcher's stderr, and
    ``print`` writes the text and its newline apart: with PYTHONUNBUFFERED two processes' lines ran into one."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def output_policy(args: argparse.Namespace) -> OutputPolicy:
    """What the user allowed for an existing OUT and the space check: the ``overwrite`` every writer of the API
    takes."""
    from ucp.io.guard import OutputPolicy

    if args.overwrite_foreign and not args.overwrite:
        raise UcpError("--overwrite-foreign widens --overwrite to folders ucp did not write; pass both")
    return OutputPolicy(overwrite=args.overwrite, foreign=args.overwrite_foreign, space_check=not args.no_space_check)


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
