"""Planning a native write: every choice (DP, stage, flavour, dtype, sub-groups, step) fixed as data.

What ``ucp restore --dry-run`` and ``ucp migrate --dry-run`` show; the writers only carry it out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ucp.deepspeed.states import stage0_note, unknown_clipping_note
from ucp.errors import ConfigError
from ucp.model import flavours
from ucp.model.batch import global_batch_note
from ucp.model.detect import nvme_note, offloads_optimizer, round_robin_gradients, unsaved_state_reason, wide_state_note
from ucp.model.flavours import conversion_note, factored_note, muon_layout_note
from ucp.model.loss_scale import fp16_hysteresis_note, fp16_start_note
from ucp.model.names import compiled_names_note
from ucp.model.options import Decided, RestoreOptions, zero_label
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
    writer says it in Trainer's flags instead); ``sets``: param groups whose ranks hold different members.
    Decisions only: what each feature has to say about them comes from its own module (:data:`_FEATURE_NOTES`)."""
    name = _flavour_name(facts, options)
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
    plan.zero12_sets = dict(sets or {})
    if options.stage == 3:
        plan.layout = _zero3_layout(facts, plan)
    decided = Decided(facts, options, plan.flavour, plan.dtype, plan.offload, has_state, size)
    say = _FEATURE_NOTES + ((global_batch_note,) if batch_note else ()) + (conversion_note,)
    plan.notes += [note for note in (each(decided) for each in say) if note]
    return plan


def _flavour_name(facts: Facts, options: RestoreOptions) -> str:
    """The new run's optimizer flavour, after every problem of the options against the source is refused together."""
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
    if problems or name is None:
        raise ConfigError("; ".join(problems))
    return name


def _zero3_layout(facts: Facts, plan: NativePlan) -> Zero3Layout:
    """The new run's ZeRO-3 sub-groups and partitions: each param group over every rank, or a group cut in sets
    (experts) over the ranks of each set."""
    numels = [[facts.param(n).numel for n in names] for names in plan.group_names]
    counts = [plan.dp] * len(numels)
    for g, cut in plan.zero12_sets.items():
        if plan.dp % cut.count:
            raise ConfigError(f"param group {g} is cut in {cut.count} sets, which do not divide dp={plan.dp}")
        numels[g], counts[g] = _set_numels(facts, g, cut), plan.dp // cut.count
    return zero3_layout(numels, plan.dp, plan.sub_group_size, counts if plan.zero12_sets else None)


def _default_sub_group_note(decided: Decided) -> str | None:
    """A ZeRO-3 write for a source that records no sub_group_size (a DCP folder) assumed DeepSpeed's default."""
    facts, options = decided.facts, decided.options
    if options.stage != 3 or options.sub_group_size is not None or facts.info.sub_group_size is not None:
        return None
    return (
        f"the source records no sub_group_size: the ZeRO-3 files are cut for DeepSpeed's default "
        f"({decided.sub_group_size:,}); a new run configured with another zero_optimization.sub_group_size refuses "
        "them at load: give it with --sub-group-size N (migration YAML: target.sub_group_size)"
    )


#: what each feature says about a native write, from its own module, in the order a user reads them (batch advice
#: and the optimizer conversion follow)
_FEATURE_NOTES: tuple[Callable[[Decided], str | None], ...] = (
    fp16_hysteresis_note,
    stage0_note,
    _default_sub_group_note,
    muon_layout_note,
    compiled_names_note,
    factored_note,
    wide_state_note,
    unknown_clipping_note,
    fp16_start_note,
    nvme_note,
)


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


def param_step(plan: NativePlan, state: ParamState | PieceState) -> int:
    """The step a target writes for one parameter under the plan."""
    if plan.step is not None:
        return plan.step
    return int(state.step or 0)
