"""The ``ucp`` command: argparse verbs mapped onto the Python API, nothing more.

Expected failures (UcpError) print one line to stderr and exit non-zero; ``--debug`` keeps the
traceback. Anything else is a bug and keeps its traceback. Every verb that writes checks its output
with ``ucp.io.guard`` first (never over an input, never over a folder ucp did not write, room on
the disk) and runs inside ``ucp.io.signals.stop_on_signals`` (SIGTERM and SIGHUP act like Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ucp import __version__
from ucp.errors import Stopped, UcpError
from ucp.io.signals import held_signals, raise_if_stopped, stop_on_signals

if TYPE_CHECKING:  # the CLI imports torch only once a verb runs: --help, --version and Ctrl-C stay quick
    from ucp.io.guard import OutputPolicy
    from ucp.model.records import Facts, Reader
    from ucp.targets.native import NativePlan

__all__ = ["main", "build_parser"]

logger = logging.getLogger("ucp")
#: every optimizer flavour (ucp.model.flavours.FLAVOURS; spelled here so that --help needs no torch, kept equal by a test)
FLAVOUR_NAMES = (
    "torch-adam", "ds-fused-adam", "ds-cpu-adam", "apex-fused-adam", "torch-sgd", "torch-rmsprop", "torch-nadam",
    "torch-radam", "torch-adamax", "torch-adagrad", "ds-cpu-adagrad", "ds-lion", "ds-muon", "ds-muon-torch-adam",
)  # fmt: skip
#: optimizers a DCP output can be written for (ucp.targets.dcp.DCP_OPTIMIZERS)
DCP_OPTIMIZER_NAMES = (
    "torch-adamw", "torch-adam", "torch-sgd", "torch-rmsprop", "torch-nadam", "torch-radam", "torch-adamax",
    "torch-adagrad",
)  # fmt: skip


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _policy(args: argparse.Namespace) -> OutputPolicy:
    """What the user allowed for an existing OUT and the space check."""
    from ucp.io.guard import OutputPolicy

    if args.overwrite_foreign and not args.overwrite:
        raise UcpError("--overwrite-foreign widens --overwrite to folders ucp did not write; pass both")
    return OutputPolicy(overwrite=args.overwrite, foreign=args.overwrite_foreign, space_check=not args.no_space_check)


@contextlib.contextmanager
def _output(
    args: argparse.Namespace, src: str, open_source: Callable[[], Reader], size: Callable[[Facts], int]
) -> Iterator[Reader]:
    """The one way a verb writes ``args.out`` from ``src``: OUT checked against the input and the
    user's flags (ucp.io.guard.check_output) before the input is opened, then the write inside
    ucp.io.guard.writing (space check from ``size`` of the input's facts; faults as one line)."""
    from ucp.io.guard import check_output, writing

    policy = _policy(args)
    check_output(args.out, {"source": src}, policy)
    with open_source() as reader, writing({Path(args.out): size(reader.facts)}, policy):
        yield reader


def _weights(args: argparse.Namespace) -> Callable[[Facts], int]:
    """The size estimate of an output holding the weights at ``--dtype`` (a lower bound of any restore)."""
    from ucp.io.guard import weight_bytes

    return lambda facts: weight_bytes(facts, getattr(args, "dtype", None))


def _universal_size(facts: Facts) -> int:
    """The size estimate of a universal directory of ``facts``."""
    from ucp.io.guard import universal_bytes

    return universal_bytes(facts)


def _done(args: argparse.Namespace, summary: str, notes: Sequence[str] = (), **data: Any) -> int:
    """A writing verb's result: the summary line on stdout (notes on stderr), or with --json one object
    on stdout (``summary``, ``notes``, ``out`` and the verb's own fields); --quiet prints nothing."""
    if getattr(args, "json", False):
        print(json.dumps({"verb": args.verb, "out": str(args.out), "summary": summary, "notes": list(notes), **data}))
    elif not args.quiet:
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        print(summary)
    return 0


def _cmd_to_universal(args: argparse.Namespace) -> int:
    if args.distributed:
        if args.frozen:
            raise UcpError("--frozen is not supported with --distributed; convert the DCP folder in one process")
        from ucp.ops.distributed import to_universal_distributed

        manifest = to_universal_distributed(
            args.src, args.out, tag=args.tag, optimizer=args.optimizer, workers=args.workers, policy=_policy(args)
        )
        if manifest is None:  # ranks other than 0 report nothing
            return 0
    else:
        from ucp.universal.writer import write_universal

        with _output(args, args.src, lambda: _to_universal_source(args), _universal_size) as reader:
            manifest = write_universal(
                reader, args.out, overwrite=args.overwrite, workers=args.workers, fsync=args.fsync
            )
    count = len(manifest["params"])
    return _done(args, f"wrote {count} parameters to {args.out}", manifest.get("warnings", []), parameters=count)


def _to_universal_source(args: argparse.Namespace) -> Reader:
    """The source; a DCP folder whose frozen parameters the user names (one rank's save cannot tell
    them from buffers) with --frozen."""
    from ucp.sources import open_reader

    if not args.frozen:
        return open_reader(args.src, tag=args.tag, optimizer=args.optimizer)
    from ucp.sources.dcp import DcpSource, is_dcp

    if not is_dcp(args.src):
        raise UcpError(f"--frozen names frozen parameters of a DCP folder; {args.src} holds no .metadata")
    return DcpSource(args.src, optimizer=args.optimizer, names={"frozen": args.frozen})


def _cmd_restore_dcp(args: argparse.Namespace) -> int:
    from ucp.sources import open_reader
    from ucp.targets.dcp import write_dcp

    with _output(args, args.universal, lambda: open_reader(args.universal, tag=args.tag), _weights(args)) as reader:
        write_dcp(
            reader,
            args.out,
            optimizer=args.optimizer or "torch-adamw",
            layout=args.dcp_layout or "torch",
            overwrite=args.overwrite,
            fsync=args.fsync,
        )
    layout = f", {args.dcp_layout} layout" if args.dcp_layout else ""
    optimizer = args.optimizer or "torch-adamw"
    summary = f"wrote a torch.distributed.checkpoint folder ({optimizer}{layout}) to {args.out}"
    return _done(args, summary, format="dcp", optimizer=optimizer, layout=args.dcp_layout or "torch")


def _native_options(args: argparse.Namespace, step: int | str, stage: int | None) -> dict[str, Any]:
    """The restore flags a native checkpoint (bare or inside a Hugging Face folder) is written with."""
    return {
        "dp": args.dp,
        "stage": stage,
        "optimizer": args.optimizer,
        "dtype": args.dtype,
        "tag": args.tag,
        "sub_group_size": args.sub_group_size,
        "step": step,
        "tp": args.tp,
        "offload": args.offload,
        "overwrite": args.overwrite,
        "workers": args.workers,
        "fsync": args.fsync,
    }


def _cmd_restore_hf(args: argparse.Namespace, step: int | str, tag: str) -> int:
    from ucp.sources import open_reader
    from ucp.targets.hf import write_hf

    # write_hf opens the folder itself (it needs its files too); the reader here gives the size
    with _output(args, args.universal, lambda: open_reader(args.universal, tag=tag), _weights(args)):
        result = write_hf(args.universal, args.out, **_native_options(args, step, args.stage))
    summary = (
        f"wrote {'a Trainer' if result.folder.kind == 'trainer' else 'an Accelerate'} folder for "
        f"{result.world} process{'es' if result.world > 1 else ''} (ZeRO-{result.plan.stage}, tag "
        f"{result.plan.tag}, {len(result.folder.files)} files copied, {len(result.rng)} RNG files) to {args.out}"
    )
    return _done(
        args,
        summary,
        result.notes,
        format=result.folder.kind,
        processes=result.world,
        stage=result.plan.stage,
        tag=result.plan.tag,
        files_copied=list(result.folder.files),
        rng_files=[new for _, new in result.rng],
    )


def _cmd_restore(args: argparse.Namespace) -> int:
    from ucp.sources import open_reader
    from ucp.targets.native import write_native

    if args.format == "dcp":
        if args.ep is not None:
            raise UcpError("--ep describes a DeepSpeed MoE output; drop --format dcp")
        return _cmd_restore_dcp(args)
    if args.dcp_layout:
        raise UcpError("--dcp-layout describes a DCP output; add --format dcp")
    if args.dp is None:
        raise UcpError("restore needs --dp N (the data-parallel size of the new run), or --format dcp")

    step: int | str = args.step
    if isinstance(step, str) and step.isdigit():
        step = int(step)
    from ucp.sources.hf import find_hf_folder

    hf = find_hf_folder(args.universal)
    if hf is not None:
        return _cmd_restore_hf(args, step, hf.tag)
    if args.ep is not None and (args.pp is not None or args.distributed):
        raise UcpError(
            "--ep writes a legacy MoE checkpoint at PP=1 in one process (or an AutoEP one): drop --pp and --distributed"
        )
    if args.pp is not None:
        return _cmd_restore_pipeline(args, step)
    if args.distributed:
        return _cmd_native_distributed(args, step)
    with _output(args, args.universal, lambda: open_reader(args.universal), _weights(args)) as reader:
        if args.ep is not None or _is_moe(reader.facts):
            return _write_experts(args, reader, step)
        plan = write_native(reader, args.out, **_native_options(args, step, _stage(args, reader.facts)))
    return _native_done(args, plan)


def _is_moe(facts: Facts) -> bool:
    """Expert param groups (``moe: True``): a legacy MoE or an AutoEP run."""
    from ucp.targets.moe import is_moe

    return is_moe(facts)


def _refuse_moe(facts: Facts, flag: str) -> None:
    """A MoE checkpoint restored any other way would load as a dense model with every expert on every rank."""
    if _is_moe(facts):
        raise UcpError(f"the source is a mixture-of-experts run, which {flag} cannot write: restore without it (--ep)")


class _ExpertTarget(NamedTuple):
    """How a run with experts is written: legacy MoE (``ucp.targets.moe``) or AutoEP (``ucp.targets.autoep``)."""

    kind: str  # in the summary line
    format: str  # --json's ``format``
    size: str  # what DeepSpeed calls the expert-parallel size
    write: Callable[..., NativePlan]
    source_ep_size: Callable[[Reader], int]


def _expert_target(reader: Reader) -> _ExpertTarget:
    """The writer the source's experts need: AutoEP when its reader records AutoEP layers, else legacy MoE
    (which refuses a source without MoE layers in one line)."""
    from ucp.targets import autoep, moe

    if autoep.is_autoep(reader):
        return _ExpertTarget("an AutoEP", "deepspeed-autoep", "autoep_size", autoep.write_autoep, autoep.source_ep_size)
    return _ExpertTarget("a MoE", "deepspeed-moe", "ep_size", moe.write_moe, moe.source_ep_size)


def _write_experts(args: argparse.Namespace, reader: Reader, step: int | str) -> int:
    """A legacy-MoE or AutoEP checkpoint for --dp ranks at --ep, which defaults to the source's expert-parallel
    size (the one DeepSpeed setting a run with experts cannot load its checkpoint without)."""
    target = _expert_target(reader)
    ep = args.ep if args.ep is not None else target.source_ep_size(reader)
    if args.ep is None and args.dp % ep:
        raise UcpError(f"the source's {target.size}={ep} does not divide --dp {args.dp}: give the new run's --ep")
    # a run with experts is ZeRO-1/2 here: the source's stage unless told
    options = _native_options(args, step, args.stage or reader.facts.info.zero_stage)
    plan = target.write(reader, args.out, ep=ep, **options)
    summary = (
        f"wrote {target.kind} checkpoint for dp={plan.dp} at {target.size}={ep} (ZeRO-{plan.stage}, "
        f"{plan.flavour.name}, {plan.dtype}) to {args.out}/{plan.tag}"
    )
    return _done(
        args,
        summary,
        plan.notes,
        format=target.format,
        stage=plan.stage,
        dp=plan.dp,
        ep=ep,
        optimizer=plan.flavour.name,
        dtype=plan.dtype,
        tag=plan.tag,
    )


def _stage(args: argparse.Namespace, facts: Facts) -> int:
    """restore writes ZeRO-3 unless told; reshard keeps the source's stage unless told."""
    return int(args.stage or (facts.info.zero_stage if args.verb == "reshard" else 3))


def _cmd_native_distributed(args: argparse.Namespace, step: int | str) -> int:
    """restore / reshard under torchrun: each rank writes its share; rank 0 reports."""
    from ucp.model.options import RestoreOptions
    from ucp.ops.distributed import write_native_distributed

    fields = _native_options(args, step, None)
    for key in ("overwrite", "workers", "fsync", "stage"):
        fields.pop(key)

    def options(facts: Facts) -> RestoreOptions:
        _refuse_moe(facts, "--distributed")
        return RestoreOptions(stage=_stage(args, facts), **fields)

    plan = write_native_distributed(
        args.universal,
        args.out,
        options,
        workers=args.workers,
        policy=_policy(args),
        fsync=args.fsync,
    )
    return 0 if plan is None else _native_done(args, plan)


def _native_done(args: argparse.Namespace, plan: NativePlan) -> int:
    tp = f" tp={plan.tp}" if plan.tp > 1 else ""
    summary = (
        f"wrote a ZeRO-{plan.stage} checkpoint for dp={plan.dp}{tp} ({plan.flavour.name}, {plan.dtype}) to "
        f"{args.out}/{plan.tag}"
    )
    return _done(
        args,
        summary,
        plan.notes,
        format="deepspeed",
        stage=plan.stage,
        dp=plan.dp,
        tp=plan.tp,
        optimizer=plan.flavour.name,
        dtype=plan.dtype,
        tag=plan.tag,
    )


def _cmd_restore_pipeline(args: argparse.Namespace, step: int | str) -> int:
    """A native pipeline-parallel checkpoint: per-stage ZeRO-1 files and layer files for --pp x --tp x --dp."""
    from ucp.sources import open_reader
    from ucp.targets.pipeline import PipelineLayout, write_pipeline

    if (args.pp_parts is None) == (args.pp_partition is None):
        raise UcpError(
            "--pp needs the new run's layer partition: --pp-parts 0,3,6 (its PipelineModule.parts) or "
            "--pp-partition uniform|parameters --pp-layers N (its partition_method), and --pp-tied KEY=LAYERS for "
            "each TiedLayerSpec key"
        )
    if args.pp_partition is not None and args.pp_layers is None:
        raise UcpError("--pp-partition needs --pp-layers: the length of the PipelineModule's layer list")
    tied = PipelineLayout.parse_tied(args.pp_tied or ())
    if args.pp_parts is not None:
        layout = PipelineLayout.parse(args.pp_parts, args.pp_tied or ())
        if layout.pp != args.pp:
            raise UcpError(f"--pp-parts {args.pp_parts} cuts {layout.pp} stages, but --pp is {args.pp}")
    with _output(args, args.universal, lambda: open_reader(args.universal), _weights(args)) as reader:
        _refuse_moe(reader.facts, "--pp")
        if args.pp_partition is not None:
            layout = PipelineLayout.by_method(args.pp_partition, args.pp, args.pp_layers, tied, reader.facts)
        # PipelineEngine runs ZeRO-0/1 only: stage 1 unless told
        plan = write_pipeline(reader, args.out, layout, **_native_options(args, step, args.stage or 1))
    summary = (
        f"wrote a pipeline checkpoint for pp={layout.pp} x tp={plan.tp} x dp={plan.dp} (ZeRO-{plan.stage}, "
        f"{plan.flavour.name}, "
        f"{plan.dtype}) to {args.out}/{plan.tag}"
    )
    return _done(
        args,
        summary,
        plan.notes,
        format="deepspeed-pipeline",
        stage=plan.stage,
        pp=layout.pp,
        parts=list(layout.parts),
        tp=plan.tp,
        dp=plan.dp,
        optimizer=plan.flavour.name,
        dtype=plan.dtype,
        tag=plan.tag,
    )


def _cmd_reshard(args: argparse.Namespace) -> int:
    """restore's native path under the name people look for: one pass, shards in, shards out."""
    if args.dp is None:
        raise UcpError("reshard needs --dp N (the data-parallel size of the new run)")
    return _cmd_restore(args)


def _cmd_inspect(args: argparse.Namespace) -> int:
    from ucp.ops.inspect import format_report, inspect_path

    report = inspect_path(args.path, tag=args.tag, optimizer=args.optimizer)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from ucp.ops.verify import verify_model, verify_universal

    if args.model and args.universal:
        raise UcpError("give either UNIVERSAL or --model, not both")
    if args.model:
        result = verify_model(args.source, args.model, tag=args.tag)
    elif args.universal:
        result = verify_universal(args.source, args.universal, tag=args.tag)
    else:
        raise UcpError("verify needs UNIVERSAL (to compare against SOURCE) or --model MODULE:CALLABLE")
    print(result.message)
    return 0 if result.ok else 1


def _cmd_diff(args: argparse.Namespace) -> int:
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
    else:
        for line in report.lines():
            print(line)
        if args.plot and not args.quiet:
            print(f"note: wrote the chart to {args.plot}", file=sys.stderr)
    return 0 if report.equal else 1


def _cmd_export(args: argparse.Namespace) -> int:
    from ucp.sources import open_reader
    from ucp.targets.export import export

    with _output(args, args.src, lambda: open_reader(args.src, tag=args.tag), _weights(args)) as reader:
        written = export(
            reader,
            args.out,
            format=args.format,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
        )
    return _done(args, f"wrote {len(written)} file(s) to {args.out}", files=[str(p) for p in written])


def _cmd_migrate(args: argparse.Namespace) -> int:
    from ucp.migrate import run_migration

    text = run_migration(args.config, dry_run=args.dry_run, policy=_policy(args))
    if args.json:
        print(json.dumps({"verb": "migrate", "dry_run": args.dry_run, "lines": text.splitlines()}))
    elif not args.quiet:
        print(text)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from ucp.harness.demo import run_demo

    return run_demo(args.workdir, source_dp=args.source_dp, target_dp=args.target_dp)


def _output_flags(p: argparse.ArgumentParser, *, fsync: bool = False) -> None:
    """The flags of every verb that writes: what may be replaced, the space check, durability."""
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists and ucp wrote it")
    p.add_argument(
        "--overwrite-foreign",
        action="store_true",
        help="with --overwrite: replace OUT even when ucp did not write it (never an input)",
    )
    p.add_argument(
        "--no-space-check",
        action="store_true",
        help="write even when the file system seems to lack room for the output",
    )
    if fsync:
        p.add_argument("--fsync", action="store_true", help="flush OUT to disk before publishing it (power-loss safe)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")


def _new_run_flags(p: argparse.ArgumentParser) -> None:
    """The new run's layout and optimizer, shared by restore and reshard; then the output flags."""
    p.add_argument(
        "--dp", type=_positive, help="data-parallel size of the new run (restore needs it unless --format dcp)"
    )
    p.add_argument(
        "--stage",
        type=int,
        choices=(1, 2, 3),
        help="ZeRO stage of the new run (default 3; a Hugging Face folder's own)",
    )
    p.add_argument(
        "--tp",
        type=_positive,
        default=1,
        help="tensor-parallel degree of the new run (default 1; > 1 needs --stage 1 or 2)",
    )
    p.add_argument(
        "--pp",
        type=_positive,
        help="pipeline stages of the new run: a PipelineEngine checkpoint (stage defaults to 1; needs --pp-parts or "
        "--pp-partition)",
    )
    p.add_argument("--pp-parts", metavar="0,3,6", help="--pp: the new run's layer partition (PipelineModule.parts)")
    p.add_argument(
        "--pp-partition",
        choices=("uniform", "parameters"),
        help="--pp: cut the layers as the new run's partition_method will (instead of --pp-parts; needs --pp-layers)",
    )
    p.add_argument("--pp-layers", type=_positive, metavar="N", help="--pp-partition: the PipelineModule's layer count")
    p.add_argument(
        "--pp-tied",
        action="append",
        metavar="KEY=0,5",
        help="--pp: the layers using TiedLayerSpec KEY (repeat per key)",
    )
    p.add_argument(
        "--ep",
        type=_positive,
        help="expert-parallel size of the new run: a legacy DeepSpeed MoE or AutoEP checkpoint (ZeRO-1/2; default "
        "for a source with experts: its own ep_size or autoep_size, and its stage)",
    )
    p.add_argument(
        "--optimizer",
        choices=sorted(set(FLAVOUR_NAMES) | set(DCP_OPTIMIZER_NAMES)),
        help="optimizer of the new run (default: the source's; torch-adamw for --format dcp)",
    )
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="model dtype of the new run (default: source's)")
    p.add_argument("--tag", help="tag folder name (default: global_step<N>)")
    p.add_argument("--sub-group-size", type=_positive, help="ZeRO-3 sub_group_size of the new run (default: source's)")
    p.add_argument("--step", default="keep", help="keep (default), reset, or an integer")
    p.add_argument(
        "--offload",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the new run offloads its optimizer (offload_optimizer): DeepSpeed Muon lays its ZeRO-1/2 momentum "
        "out by it (default: as the source did)",
    )
    p.add_argument("--workers", type=_positive, help="threads reading and writing (default: the CPUs ucp may use)")
    p.add_argument(
        "--distributed",
        action="store_true",
        help="split the rank files across torch.distributed ranks (launch with torchrun; OUT on a shared file system)",
    )
    _output_flags(p, fsync=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ucp", description="Universal checkpoints for DeepSpeed ZeRO.", allow_abbrev=False
    )
    parser.add_argument("--version", action="version", version=f"ucp {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logging")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress")
    parser.add_argument(
        "-q", "--quiet", action="store_true", help="print nothing but errors (no result line, notes or progress bars)"
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = verbs.add_parser("to-universal", help="DeepSpeed ZeRO or DCP checkpoint -> universal directory")
    p.add_argument("src", help="checkpoint folder (holding 'latest'), a tag folder, or a DCP folder (.metadata)")
    p.add_argument("out", help="universal directory to create")
    p.add_argument("--tag", help="tag folder to read (default: the one 'latest' names)")
    p.add_argument("--optimizer", choices=FLAVOUR_NAMES, help="the source's optimizer, when detection cannot tell")
    p.add_argument("--workers", type=_positive, help="parallel workers (default: CPU count, at most 8)")
    _output_flags(p, fsync=True)
    p.add_argument(
        "--frozen",
        nargs="+",
        metavar="NAME",
        help="DCP source: these entries are frozen parameters, not buffers (a one-rank save cannot tell them apart)",
    )
    p.add_argument(
        "--distributed",
        action="store_true",
        help="split the work across torch.distributed ranks (launch with torchrun)",
    )
    p.set_defaults(func=_cmd_to_universal)

    p = verbs.add_parser("restore", help="universal directory -> native ZeRO checkpoint for a DP size, or DCP")
    p.add_argument(
        "universal",
        help="universal directory (or a DeepSpeed or DCP checkpoint); a Trainer checkpoint-N or Accelerate "
        "save_state folder gives a whole folder of the same kind for the new size",
    )
    p.add_argument("out", help="checkpoint folder to create (gets 'latest' and the tag folder)")
    p.add_argument(
        "--format",
        choices=("deepspeed", "dcp"),
        default="deepspeed",
        help="deepspeed (default): a native ZeRO checkpoint; dcp: a torch.distributed.checkpoint folder for FSDP2",
    )
    p.add_argument(
        "--dcp-layout",
        choices=("torch", "torchtitan"),
        help="--format dcp: torch (default; get_state_dict's model/optim) or torchtitan (its CheckpointManager's keys)",
    )
    _new_run_flags(p)
    p.set_defaults(func=_cmd_restore)

    p = verbs.add_parser(
        "reshard", help="DeepSpeed checkpoint -> DeepSpeed checkpoint for another DP/stage/TP, no universal copy"
    )
    p.add_argument("universal", metavar="src", help="DeepSpeed checkpoint (or any source restore reads)")
    p.add_argument("out", help="checkpoint folder to create (gets 'latest' and the tag folder)")
    _new_run_flags(p)
    p.set_defaults(func=_cmd_reshard, format="deepspeed", dcp_layout=None)

    p = verbs.add_parser("inspect", help="summarize a DeepSpeed checkpoint or universal directory")
    p.add_argument("path", help="DeepSpeed checkpoint, universal directory, DCP or Hugging Face folder")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--tag", help="DeepSpeed tag folder to read (default: the one `latest` names)")
    p.add_argument("--optimizer", choices=FLAVOUR_NAMES, help="the optimizer flavour, when detection cannot tell")
    p.set_defaults(func=_cmd_inspect)

    p = verbs.add_parser(
        "verify", help="check a universal directory against its source, or a model against a checkpoint"
    )
    p.add_argument("source", help="DeepSpeed checkpoint (or universal directory with --model)")
    p.add_argument("universal", nargs="?", help="universal directory to compare bit for bit")
    p.add_argument("--model", help="MODULE:CALLABLE building the model whose names/shapes/order to check")
    p.add_argument("--tag", help="DeepSpeed tag folder to read (default: the one `latest` names)")
    p.set_defaults(func=_cmd_verify)

    p = verbs.add_parser(
        "diff", help="compare two checkpoints of any format, parameter by parameter and state key by state key"
    )
    p.add_argument("a", help="checkpoint A (DeepSpeed ZeRO at any DP/TP, universal, DCP, Hugging Face folder)")
    p.add_argument("b", help="checkpoint B, any format too")
    p.add_argument(
        "--atol", type=_non_negative, default=0.0, help="largest difference counted as equal (default 0: bit for bit)"
    )
    p.add_argument("--tag-a", help="DeepSpeed tag to read in A (default: latest)")
    p.add_argument("--tag-b", help="DeepSpeed tag to read in B (default: latest)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--plot", metavar="FILE", help="also draw each parameter's differences into FILE (.png, .svg, .pdf; matplotlib)"
    )
    p.add_argument("--overwrite", action="store_true", help="replace the --plot FILE if it exists")
    p.set_defaults(func=_cmd_diff)

    p = verbs.add_parser("export", help="consolidated weights (safetensors or torch)")
    p.add_argument("src", help="universal directory or DeepSpeed checkpoint")
    p.add_argument("out", help="output file (model.safetensors / pytorch_model.bin) or folder when sharded")
    p.add_argument(
        "--format", choices=("safetensors", "torch"), default="safetensors", help="file format (default safetensors)"
    )
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="default: the model's dtype")
    p.add_argument("--max-shard-size", default="5GB", help="shard above this size, e.g. 500MB, 5GB (default 5GB)")
    p.add_argument("--tag", help="DeepSpeed tag folder to read (default: the one `latest` names)")
    _output_flags(p)
    p.set_defaults(func=_cmd_export)

    p = verbs.add_parser("migrate", help="run a YAML migration (read, transform, restore, export)")
    p.add_argument("config", help="migration YAML")
    p.add_argument("--dry-run", action="store_true", help="print the plan, write nothing")
    _output_flags(p)
    p.set_defaults(func=_cmd_migrate)

    p = verbs.add_parser("demo", help="train a tiny model with real DeepSpeed, convert, restore at another DP, compare")
    p.add_argument(
        "--workdir",
        default="ucp-demo",
        help="folder for the demo's checkpoints: new, empty, or one an earlier demo made (default ./ucp-demo)",
    )
    p.add_argument("--source-dp", type=_positive, default=4, help="DP size of the training run saved (default 4)")
    p.add_argument("--target-dp", type=_positive, default=2, help="DP size the run resumes at (default 2)")
    p.set_defaults(func=_cmd_demo)
    for sub in verbs.choices.values():  # "--over" must not pass for --overwrite
        sub.allow_abbrev = False
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
        print(f"ucp: interrupted by {name} while starting; nothing was written", file=sys.stderr)
        return 128 + held[0]
    try:
        with stop_on_signals():
            code = args.func(args)
            raise_if_stopped()  # a library swallowed the signal's exception: the command still ends as stopped
            return code
    except UcpError as err:
        if args.debug:
            raise
        print(f"ucp: error: {err}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # `ucp inspect CKPT | head`: the reader left; say nothing more, as `cat` would
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's final flush of stdout must not fail again
        return 141  # 128 + SIGPIPE, what a shell reports for a command a pipe closed
    except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM, SIGHUP (ucp.errors.Stopped): staging already removed
        name = err.name if isinstance(err, Stopped) else "Ctrl-C"
        print(f"ucp: interrupted by {name}; nothing was left half-written", file=sys.stderr)
        return err.exit_code if isinstance(err, Stopped) else 130


if __name__ == "__main__":
    sys.exit(main())
