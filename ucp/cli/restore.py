"""``ucp restore`` and ``ucp reshard``: any source written for a new run by the target the registry chooses
(``ucp.targets.registry``: a DeepSpeed checkpoint, in one process or under torchrun, a pipeline, legacy MoE or AutoEP
one, a whole Hugging Face Trainer or Accelerate folder, or a torch.distributed.checkpoint folder)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from ucp.cli.output import done, output_policy
from ucp.errors import UcpError

if TYPE_CHECKING:
    from ucp.model.options import RestoreOptions
    from ucp.model.records import Facts
    from ucp.targets.format import Request

__all__ = ["cmd_reshard", "cmd_restore"]


def _request(args: argparse.Namespace) -> Request:
    """The flags as a target's request: every declared option by name, and how OUT is written."""
    from ucp.model.option_table import OPTIONS
    from ucp.targets.format import Request

    values = {o.name: getattr(args, o.name) for o in OPTIONS}
    if isinstance(values["step"], str) and values["step"].isdigit():
        values["step"] = int(values["step"])
    return Request(values, overwrite=output_policy(args), workers=args.workers, fsync=args.fsync)


def cmd_restore(args: argparse.Namespace) -> int:
    from ucp.sources import open_reader
    from ucp.targets.registry import choose, refuse_options, target_format, write_chosen

    request = _request(args)
    if args.format != "deepspeed":  # a format named outright is refused its options before anything is read
        refuse_options(target_format(args.format), request)
    elif args.dp is None:
        also = ", or --format dcp" if args.verb == "restore" else ""
        raise UcpError(f"{args.verb} needs --dp N (the data-parallel size of the new run){also}")
    with open_reader(args.universal) as reader:
        target = choose(reader, request, args.format)
        refuse_options(target, request)
        if not args.distributed:
            written = write_chosen(target, reader, args.out, request)
            return done(args, written.summary, written.notes, **written.fields)
    return _distributed(args, request)


def _distributed(args: argparse.Namespace, request: Request) -> int:
    """restore / reshard under torchrun: each rank writes its share; rank 0 reports."""
    from ucp.ops.distributed import write_native_distributed
    from ucp.targets.native import native_written

    def options(facts: Facts) -> RestoreOptions:
        return request.restore_options(facts.info.zero_stage)

    plan = write_native_distributed(
        args.universal, args.out, options, workers=args.workers, policy=output_policy(args), fsync=args.fsync
    )
    if plan is None:  # ranks other than 0 report nothing
        return 0
    written = native_written(plan, args.out)
    return done(args, written.summary, written.notes, **written.fields)


def cmd_reshard(args: argparse.Namespace) -> int:
    """restore's native path under the name people look for: one pass, shards in, shards out."""
    return cmd_restore(args)
