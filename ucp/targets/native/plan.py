"""Planning a native write: every choice (DP, stage, flavour, dtype, sub-groups, step) fixed as data.

What ``ucp restore --dry-run`` and ``ucp migrate --dry-run`` show; the writers only carry it out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ucp.errors import ConfigError
from ucp.model import flavours
from ucp.model.batch import global_batch_advice
from ucp.model.detect import (
    low_precision_masters,
    offloads_optimizer,
    offloads_to_nvme,
    round_robin_gradients,
    unsaved_state_reason,
)
from ucp.model.loss_scale import fresh_fp16_scale
from ucp.model.names import has_wrapper
from ucp.model.options import RestoreOptions, zero_label
from ucp.model.partition import Zero3Layout, zero3_layout
from ucp.model.records import Facts, ParamState, PieceState
from ucp.model.zenflow import zenflow_config

__all__ = ["NativePlan", "Share", "Zero12Sets", "plan_native", "param_step", "DS_DEFAULT_SUB_GROUP_SIZE"]

#: Optimizers DeepSpeed 0.19.8 wraps in its fused FP16_Optimizer without ZeRO in bf16/fp16 (others: FP16_UnfusedOptimizer).
FUSED_WRAPPED = ("ds-fused-adam", "apex-fused-adam")

#: DeepSpeed's default ``zero_optimization.sub_group_size`` (0.19.8).
DS_DEFAULT_SUB_GROUP_SIZE = 1_000_000_000


@dataclass(frozen=True)
class Zero12Sets:
    """A param group whose ranks hold different members: DeepSpeed's expert groups, where each
    expert-parallel rank holds its own experts. Set k's members are held by ranks k, k + S, k + 2S, ...
    (S sets): rank r holds partition r // S of set r % S, so each set is partitioned over dp / S ranks
    (its expert-data-parallel group, 0.19.8 ``get_ep_ranks``), at ZeRO-1/2 as at ZeRO-3 (AutoEP). The
    members live in files of their own, or in none (ZeRO-3), never in the module of the model-states file."""

    names: tuple[tuple[str, ...], ...]  # per set: the reader's names, in flat order
    labels: tuple[tuple[str, ...], ...]  # per set: the names the rank files give them

    def __post_init__(self) -> None:
        if not self.names or [len(n) for n in self.names] != [len(n) for n in self.labels]:
            raise ValueError("a Zero12Sets needs at least one set, and one label per member")

    @property
    def count(self) -> int:
        return len(self.names)

    def held(self, rank: int) -> tuple[int, int]:
        """(set, partition) of ``rank``."""
        return rank % self.count, rank // self.count

    def ranks(self, index: int, dp: int) -> list[int]:
        """The global ranks holding set ``index``, in partition order."""
        return list(range(index, dp, self.count))


@dataclass
class NativePlan:
    """Every decision of a native write, as data."""

    dp: int
    stage: int
    flavour: flavours.Flavour
    dtype: str
    tag: str
    sub_group_size: int
    step: int | None  # the step written for every optimized parameter (None: each keeps its own)
    reset_moments: bool
    group_names: list[list[str]]
    layout: Zero3Layout | None = None
    notes: list[str] = field(default_factory=list)
    tp: int = 1  # tensor-parallel degree of the checkpoint written
    mp_rank: int = 0  # the TP rank whose files are being written
    offload: bool = False  # the new run offloads its optimizer (DeepSpeed Muon's ZeRO-1/2 layout follows it)
    round_robin: bool = False  # ZeRO-1/2: each group's members flattened in round-robin order (round_robin_gradients)
    transposed: bool = False  # ZeRO-3 for a ZenFlow run: every matrix written transposed, as ZenFlow keeps it
    #: param group -> its sets of members when ranks hold different ones (others: one set, all ranks)
    zero12_sets: dict[int, Zero12Sets] = field(default_factory=dict)
    #: more fields of the model-states file (a MoE run's ``num_experts``)
    model_fields: dict[str, Any] = field(default_factory=dict)

    def whole_keys(self, facts: Facts) -> list[tuple[str, ...]]:
        """Per param group, the state keys written whole per parameter at ZeRO-1/2 (Flavour.zero12_whole_keys)."""
        return [self.flavour.zero12_whole_keys(g.raw, offload=self.offload) for g in facts.groups]


@dataclass(frozen=True)
class Share:
    """The part of a native write one process of ``count`` does: file unit ``k`` of the write (a
    ZeRO-3 rank's two files, a ZeRO-1/2 model file or one rank's optim file) when ``k % count ==
    index``; and the checking of the source files of ``checked`` parameters (None: all of them)."""

    index: int = 0
    count: int = 1
    checked: frozenset[str] | None = None

    def mine(self, unit: int) -> bool:
        return unit % self.count == self.index

    def elsewhere(self, name: str) -> bool:
        """Another process checks this parameter's source files."""
        return self.checked is not None and name not in self.checked


def plan_native(
    facts: Facts, options: RestoreOptions, *, batch_note: bool = True, sets: Mapping[int, Zero12Sets] | None = None
) -> NativePlan:
    """Check the options against the checkpoint and fix every choice of the write; ``batch_note``: say
    which DeepSpeed batch settings keep the global batch at the new DP size (a Hugging Face folder's
    writer says it in Trainer's flags instead); ``sets``: param groups whose ranks hold different members."""
    problems = options.problems()
    trained = any(not p.frozen for p in facts.params)
    if trained and not options.reset and not any(g.state_keys for g in facts.groups):
        problems.append(
            f"the source holds no optimizer state ({unsaved_state_reason(facts.info.ds_config)}): restore with "
            "--step reset to start every moment at zero"
        )
    name = options.optimizer or facts.flavour
    if name is None:
        problems.append(
            f"the source's optimizer flavour is unknown; name it with --optimizer ({', '.join(flavours.FLAVOURS)})"
        )
    if problems:
        raise ConfigError("; ".join(problems))
    assert name is not None  # for mypy: checked just above
    size = options.sub_group_size or facts.info.sub_group_size or DS_DEFAULT_SUB_GROUP_SIZE
    group_names = [list(g.params) for g in facts.groups]
    tag = options.tag or f"global_step{facts.info.global_steps}"
    if "/" in tag or tag in ("", ".", ".."):
        raise ConfigError(f"tag {tag!r} is not a folder name")
    plan = NativePlan(
        dp=options.dp,
        stage=options.stage,
        flavour=flavours.get(name),
        dtype=options.dtype or facts.info.dtype,
        tag=tag,
        sub_group_size=size,
        step=options.fixed_step,
        reset_moments=options.reset,
        group_names=group_names,
        tp=options.tp,
        offload=offloads_optimizer(facts.info.ds_config) if options.offload is None else options.offload,
    )
    config = facts.info.ds_config
    if options.stage in (1, 2):
        plan.round_robin = _layout_setting(
            plan,
            options.round_robin_gradients,
            round_robin_gradients(config),
            "written for a run with zero_optimization.round_robin_gradients=true (each group's parameters "
            "flattened in round-robin order over the ranks): the new run must set it too",
            "--no-round-robin-gradients",
        )
    elif options.round_robin_gradients:
        raise ConfigError(f"round_robin_gradients applies to ZeRO-1/2, not {zero_label(options.stage)}")
    if options.stage == 3:
        plan.transposed = _layout_setting(
            plan,
            options.zenflow,
            zenflow_config(config) is not None,
            "written for a ZenFlow run at ZeRO-3 (zero_optimization.zenflow), which keeps every matrix "
            "transposed: the new run must use ZenFlow too",
            "--no-zenflow",
        )
    if options.reset:
        flavours.check_reset(facts.flavour)
    has_state = not options.reset and any(g.state_keys for g in facts.groups)
    flavours.check_family(facts.flavour, plan.flavour, has_state, whole=options.stage == 0)
    if options.stage == 0:
        _check_zero0(sets)
        if plan.dtype == "fp16" and facts.info.dtype == "fp16" and facts.info.zero_stage:
            plan.notes.append(
                "DeepSpeed's FP16 optimizer wrappers without ZeRO keep no loss-scale hysteresis: the scale, its "
                "counters and window are carried, and an overflow halves the scale at once from here on"
            )
        files = "the one mp_rank_00_model_states.pt" if options.tp == 1 else "its TP rank's mp_rank_XX_model_states.pt"
        plan.notes.append(
            f"without ZeRO every rank loads {files}: the checkpoint serves any DP size, and the new run's optimizer "
            "must hold the trained parameters in the source's group order"
        )
    plan.zero12_sets = dict(sets or {})
    if options.stage == 3 and options.sub_group_size is None and facts.info.sub_group_size is None:
        plan.notes.append(
            f"the source records no sub_group_size: the ZeRO-3 files are cut for DeepSpeed's default ({size:,}); a "
            "new run configured with another zero_optimization.sub_group_size refuses them at load: give it with "
            "--sub-group-size N (migration YAML: target.sub_group_size)"
        )
    if options.stage == 3:
        numels = [[facts.param(n).numel for n in names] for names in group_names]
        counts = [options.dp] * len(numels)
        for g, cut in plan.zero12_sets.items():
            if options.dp % cut.count:
                raise ConfigError(f"param group {g} is cut in {cut.count} sets, which do not divide dp={options.dp}")
            numels[g], counts[g] = _set_numels(facts, g, cut), options.dp // cut.count
        plan.layout = zero3_layout(numels, options.dp, size, counts if plan.zero12_sets else None)
    muon = any(plan.flavour.zero12_whole_keys(g.raw, offload=False) for g in facts.groups)
    if options.stage in (1, 2) and not options.reset and muon:
        plan.notes.append(
            "DeepSpeed Muon's momentum is laid out "
            + ("as each rank's flat partition" if plan.offload else "whole per parameter")
            + f", as a run {'with' if plan.offload else 'without'} optimizer offload reads it "
            "(DeepSpeed would start the other from zero: set offload to match the new run)"
        )
    if has_wrapper(m.name for m in facts.params):
        plan.notes.append(
            "the names carry torch.compile's _orig_mod. wrapper (the source compiled its model before "
            "deepspeed.initialize): a run that does so too loads these files; for one that does not, rename them "
            "in a migration (rename: {pattern: '(^|\\.)_orig_mod\\.', replace: '\\1'}), or restore live with "
            "ucp.restore(engine, ...), which matches them itself"
        )
    source = flavours.FLAVOURS.get(facts.flavour or "")
    moved = (options.dp, options.stage) != (facts.info.dp_world_size, facts.info.zero_stage)
    if source is not None and source.factored and has_state and moved:
        plan.notes.append(
            f"{source.name} scales each update by the RMS of the tensor it steps, under ZeRO a rank's flat "
            f"partition: the state is carried exactly, but at dp={options.dp} {zero_label(options.stage)} the "
            "partitions differ, so the steps differ from the source run's as they would for any run of that size"
        )
    low = low_precision_masters(facts.info.ds_config)
    if low is not None and low.wide_state and options.stage > 0 and not options.reset:
        plan.notes.append(
            f"the source kept {low.masters} masters with fp32 moments ({low.option}): if the new run keeps "
            f"{low.masters} masters too, DeepSpeed 0.19.8's load_checkpoint casts the moments to {low.masters}; "
            "ucp.restore(engine, ...) keeps them fp32"
        )
    if options.stage in (1, 2) and facts.info.format == "dcp":
        plan.notes.append(
            "the source records no gradient clipping: the ZeRO-1/2 files say 1.0 (DeepSpeed 0.19's default), which "
            "DeepSpeed's load takes over the new run's gradient_clipping"
        )
    if plan.dtype == "fp16" and facts.info.dtype != "fp16":
        plan.notes.append(
            f"the run becomes fp16: its loss scaler starts {fresh_fp16_scale(facts.info.ds_config).describe()}, "
            "from the source config's fp16 block or DeepSpeed's defaults (DeepSpeed's load puts the checkpoint's "
            "scaler in place of the one the new run's config makes; ucp.restore(engine, ...) keeps the engine's)"
        )
    if offloads_to_nvme(facts.info.ds_config) and options.stage > 0:
        plan.notes.append(
            "the source swapped its optimizer to NVMe; these files hold every state themselves: load them in a "
            "run that offloads the optimizer to CPU memory or keeps it on the accelerator (an NVMe-offload run loads "
            "only its own saves' offloaded_tensors/, and DeepSpeed 0.19.8 resumes those wrong: docs/format.md)"
        )
    if batch_note:
        plan.notes += _batch_notes(facts, options.dp)
    if name != facts.flavour and facts.flavour is not None:
        plan.notes.append(f"optimizer state converted from {facts.flavour} to {name}")
    return plan


def _layout_setting(plan: NativePlan, asked: bool | None, source: bool, note: str, off_flag: str) -> bool:
    """A setting of the new run that changes the files' layout: as asked, else as the source had it; when on, a
    note says the new run needs it (and, when not asked for, which flag writes for a run without it)."""
    chosen = source if asked is None else asked
    if chosen:
        plan.notes.append(note + ("" if asked else f"; {off_flag} writes for one without"))
    return chosen


def _check_zero0(sets: Mapping[int, Zero12Sets] | None) -> None:
    """What a checkpoint without ZeRO cannot hold."""
    if sets:
        raise ConfigError("expert parameters held by some ranks only need a ZeRO stage: a stage-0 target holds all")


def _set_numels(facts: Facts, g: int, sets: Zero12Sets) -> list[int]:
    """The member sizes every set of param group g shares: one ZeRO-3 layout serves all its sets."""
    sizes = {tuple(facts.param(n).numel for n in names) for names in sets.names}
    if len(sizes) != 1 or facts.groups[g].params != [n for names in sets.names for n in names]:
        raise ConfigError(f"the sets of param group {g} do not hold members of the same sizes, set by set")
    return list(sizes.pop())


def _batch_notes(facts: Facts, new_dp: int) -> list[str]:
    """The DeepSpeed settings that keep the source's global batch at ``new_dp`` (from its saved config)."""
    config = facts.info.ds_config or {}
    micro, accum = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps", 1)
    if not isinstance(micro, int) or not isinstance(accum, int) or isinstance(micro, bool) or micro < 1 or accum < 1:
        return []
    advice = global_batch_advice(
        micro,
        accum,
        facts.info.batch_ranks,
        new_dp,
        spell=lambda b, a: f"train_micro_batch_size_per_gpu={b}, gradient_accumulation_steps={a}",
    )
    return [advice] if advice else []


def param_step(plan: NativePlan, state: ParamState | PieceState) -> int:
    """The step a target writes for one parameter under the plan."""
    if plan.step is not None:
        return plan.step
    return int(state.step or 0)
