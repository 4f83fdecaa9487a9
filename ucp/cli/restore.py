"""``ucp restore`` and ``ucp reshard``: a universal directory (or any source) written as a new run's
checkpoint: native ZeRO (in one process or under torchrun), pipeline-parallel, legacy MoE or AutoEP,
a Hugging Face Trainer or Accelerate folder, or a torch.distributed.checkpoint folder."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from ucp.cli.output import done, output_policy
from ucp.errors import UcpError

if TYPE_CHECKING:
    from ucp.model.records import Facts, Reader
    from ucp.targets.native import NativePlan

__all__ = ["cmd_reshard", "cmd_restore"]


#: restore flags that describe a DeepSpeed output (their defaults): a DCP folder holds fp32 masters for any world
_DEEPSPEED_ONLY = {
    "stage": None,
    "tp": 1,
    "pp": None,
    "pp_parts": None,
    "pp_partition": None,
    "pp_layers": None,
    "pp_tied": None,
    "ep": None,
    "dtype": None,
    "tag": None,
    "sub_group_size": None,
    "offload": None,
    "round_robin_gradients": None,
    "zenflow": None,
    "distributed": False,
}


def _cmd_restore_dcp(args: argparse.Namespace) -> int:
    from ucp.sources import open_reader
    from ucp.targets.dcp import write_dcp

    given = [f"--{k.replace('_', '-')}" for k, default in _DEEPSPEED_ONLY.items() if getattr(args, k) != default]
    if given:
        raise UcpError(
            f"{', '.join(given)} describe{'s' if len(given) == 1 else ''} a DeepSpeed output; a DCP folder holds "
            "fp32 masters that FSDP2 loads at any world size: drop --format dcp, or "
            + ("it" if len(given) == 1 else "them")
        )
    policy = output_policy(args)
    with open_reader(args.universal) as reader:
        plan = write_dcp(
            reader,
            args.out,
            optimizer=args.optimizer,
            step=args.step,
            layout=args.dcp_layout or "torch",
            overwrite=policy,
            fsync=args.fsync,
        )
    layout = f", {args.dcp_layout} layout" if args.dcp_layout else ""
    optimizer = plan.flavour
    summary = f"wrote a torch.distributed.checkpoint folder ({optimizer}{layout}) to {args.out}"
    return done(args, summary, plan.notes, format="dcp", optimizer=optimizer, layout=args.dcp_layout or "torch")


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
        "round_robin_gradients": args.round_robin_gradients,
        "zenflow": args.zenflow,
        "overwrite": output_policy(args),
        "workers": args.workers,
        "fsync": args.fsync,
    }


def _cmd_restore_hf(args: argparse.Namespace, step: int | str, tag: str) -> int:
    from ucp.model.options import zero_label
    from ucp.targets.hf import write_hf

    result = write_hf(args.universal, args.out, **_native_options(args, step, args.stage))
    summary = (
        f"wrote {'a Trainer' if result.folder.kind == 'trainer' else 'an Accelerate'} folder for "
        f"{result.world} process{'es' if result.world > 1 else ''} ({zero_label(result.plan.stage)}, tag "
        f"{result.plan.tag}, {len(result.folder.files)} files copied, {len(result.rng)} RNG files) to {args.out}"
    )
    return done(
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


def cmd_restore(args: argparse.Namespace) -> int:
    from ucp.sources import open_reader
    from ucp.targets.native import write_native

    if args.format == "dcp":
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
    with open_reader(args.universal) as reader:
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
    from ucp.model.options import zero_label

    target = _expert_target(reader)
    ep = args.ep if args.ep is not None else target.source_ep_size(reader)
    if args.ep is None and args.dp % ep:
        raise UcpError(f"the source's {target.size}={ep} does not divide --dp {args.dp}: give the new run's --ep")
    # the source's stage unless told (legacy MoE: ZeRO-1/2 only; AutoEP: ZeRO-1, 2 or 3)
    options = _native_options(args, step, _given(args.stage, reader.facts.info.zero_stage))
    plan = target.write(reader, args.out, ep=ep, **options)
    summary = (
        f"wrote {target.kind} checkpoint for dp={plan.dp} at {target.size}={ep} ({zero_label(plan.stage)}, "
        f"{plan.flavour.name}, {plan.dtype}) to {args.out}/{plan.tag}"
    )
    return done(
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
    """The source's stage unless told: a ZeRO-2 run loads a ZeRO-2 checkpoint (DeepSpeed 0.19.8 meets a ZeRO-3 one
    with a bare AssertionError); a DCP source is written as ZeRO-3."""
    return int(_given(args.stage, facts.info.zero_stage))


def _given(stage: int | None, default: int) -> int:
    """The stage the user chose (0, without ZeRO, included), else ``default``."""
    return default if stage is None else stage


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
        policy=output_policy(args),
        fsync=args.fsync,
    )
    return 0 if plan is None else _native_done(args, plan)


def _native_done(
    args: argparse.Namespace, plan: NativePlan, *, summary: str | None = None, format: str = "deepspeed", **more: Any
) -> int:
    """The result line and JSON of a native write (``summary`` and ``more`` fields for the pipeline layout)."""
    from ucp.model.options import zero_label

    tp = f" tp={plan.tp}" if plan.tp > 1 else ""
    summary = summary or (
        f"wrote a {zero_label(plan.stage)} checkpoint for dp={plan.dp}{tp} ({plan.flavour.name}, {plan.dtype}) to "
        f"{args.out}/{plan.tag}"
    )
    return done(
        args,
        summary,
        plan.notes,
        format=format,
        stage=plan.stage,
        **more,
        dp=plan.dp,
        tp=plan.tp,
        optimizer=plan.flavour.name,
        dtype=plan.dtype,
        tag=plan.tag,
    )


def _cmd_restore_pipeline(args: argparse.Namespace, step: int | str) -> int:
    """A native pipeline-parallel checkpoint: per-stage ZeRO-1 files and layer files for --pp x --tp x --dp."""
    from ucp.model.options import zero_label
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
    with open_reader(args.universal) as reader:
        _refuse_moe(reader.facts, "--pp")
        if args.pp_partition is not None:
            layout = PipelineLayout.by_method(args.pp_partition, args.pp, args.pp_layers, tied, reader.facts)
        # PipelineEngine runs ZeRO-0/1 only: stage 1 unless told
        plan = write_pipeline(reader, args.out, layout, **_native_options(args, step, _given(args.stage, 1)))
    summary = (
        f"wrote a pipeline checkpoint for pp={layout.pp} x tp={plan.tp} x dp={plan.dp} ({zero_label(plan.stage)}, "
        f"{plan.flavour.name}, {plan.dtype}) to {args.out}/{plan.tag}"
    )
    return _native_done(
        args, plan, summary=summary, format="deepspeed-pipeline", pp=layout.pp, parts=list(layout.parts)
    )


def cmd_reshard(args: argparse.Namespace) -> int:
    """restore's native path under the name people look for: one pass, shards in, shards out."""
    if args.dp is None:
        raise UcpError("reshard needs --dp N (the data-parallel size of the new run)")
    return cmd_restore(args)
