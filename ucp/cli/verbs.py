"""The verbs other than restore: to-universal, inspect, verify, diff, export, migrate and demo."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ucp.cli.output import done, output_policy, say
from ucp.errors import UcpError

if TYPE_CHECKING:
    from ucp.model.records import Reader

__all__ = ["cmd_demo", "cmd_diff", "cmd_export", "cmd_inspect", "cmd_migrate", "cmd_to_universal", "cmd_verify"]


def cmd_to_universal(args: argparse.Namespace) -> int:
    if args.distributed:
        if args.frozen:
            raise UcpError("--frozen is not supported with --distributed; convert the DCP folder in one process")
        from ucp.ops.distributed import to_universal_distributed

        manifest = to_universal_distributed(
            args.src, args.out, tag=args.tag, optimizer=args.optimizer, workers=args.workers, policy=output_policy(args)
        )
        if manifest is None:  # ranks other than 0 report nothing
            return 0
        count = len(manifest["params"])
    else:
        from ucp.universal.writer import write_universal

        policy = output_policy(args)
        with _to_universal_source(args) as reader:
            count = len(reader.facts.params)
            manifest = write_universal(
                reader, args.out, overwrite=policy, workers=args.workers, fsync=args.fsync, listed=False
            )
    return done(args, f"wrote {count} parameters to {args.out}", manifest.get("warnings", []), parameters=count)


def _to_universal_source(args: argparse.Namespace) -> Reader:
    """The source; --frozen names the frozen parameters where the files cannot tell them (a DCP folder's one-rank
    save, from buffers; a stage-0 checkpoint, from trained parameters of the same shape)."""
    from ucp.sources import open_reader

    return open_reader(args.src, tag=args.tag, optimizer=args.optimizer, frozen=args.frozen or ())


def cmd_inspect(args: argparse.Namespace) -> int:
    from ucp.ops.inspect import format_report, inspect_path

    report = inspect_path(args.path, tag=args.tag, optimizer=args.optimizer)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ucp.ops.verify import verify_model, verify_universal

    if args.model and args.universal:
        raise UcpError("give either UNIVERSAL or --model, not both")
    if args.model:
        result = verify_model(args.source, args.model, tag=args.tag)
    elif args.universal:
        result = verify_universal(args.source, args.universal, tag=args.tag)
    else:
        raise UcpError("verify needs UNIVERSAL (to compare against SOURCE) or --model MODULE:CALLABLE")
    if args.json:
        print(json.dumps({"verb": "verify", "source": args.source, **result.to_json()}))
    elif not args.quiet:
        print(result.message)
    return 0 if result.ok else 1


def cmd_diff(args: argparse.Namespace) -> int:
    from ucp.io.guard import OutputPolicy, check_output, writing
    from ucp.ops.diff import diff

    policy = OutputPolicy(overwrite=args.overwrite, foreign=args.overwrite, space_check=False)
    if args.plot:  # a chart that cannot be written is refused before the checkpoints are read
        from ucp.ops.diff_plot import check_plot, plot_report

        check_plot(args.plot)
        check_output(args.plot, {"A": args.a, "B": args.b}, policy)
    report = diff(args.a, args.b, atol=args.atol, tag_a=args.tag_a, tag_b=args.tag_b)
    if args.plot:
        with writing({Path(args.plot): 0}, policy):
            plot_report(report, args.plot, overwrite=args.overwrite)
    if args.json:
        print(json.dumps({**report.to_json(), "plot": args.plot}))
    elif not args.quiet:  # the exit code alone tells: 0 equal, 1 they differ
        for line in report.lines():
            print(line)
        if args.plot:
            say(f"note: wrote the chart to {args.plot}")
    return 0 if report.equal else 1


def cmd_export(args: argparse.Namespace) -> int:
    from ucp.sources import open_reader
    from ucp.targets.export import export, export_notes

    policy = output_policy(args)
    with open_reader(args.src, tag=args.tag) as reader:
        notes = export_notes(reader)
        written = export(
            reader,
            args.out,
            format=args.format,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            overwrite=policy,
            folder=args.src,
        )
    return done(args, f"wrote {len(written)} file(s) to {args.out}", notes, files=[str(p) for p in written])


def cmd_migrate(args: argparse.Namespace) -> int:
    from ucp.migrate import run_migration

    text = run_migration(args.config, dry_run=args.dry_run, policy=output_policy(args))
    if args.json:
        print(json.dumps({"verb": "migrate", "dry_run": args.dry_run, "lines": text.splitlines()}))
    elif not args.quiet:
        print(text)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ucp.harness.demo import run_demo

    return run_demo(args.workdir, source_dp=args.source_dp, target_dp=args.target_dp)
