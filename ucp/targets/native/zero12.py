"""Universal (or any reader) -> a native ZeRO-1/2 checkpoint that stock DeepSpeed loads at DP=N.

Call order: ``ucp.targets.native.write_plan`` calls :func:`write_zero12` for stage 1 or 2 inside
its staged output folder. One ``mp_rank_MM_model_states.pt`` (the low-precision module, frozen
parameters and all) and N ``*zero_pp_rank_R_mp_rank_MM_optim_states.pt`` files are written with
every field DeepSpeedZeroOptimizer writes, recomputed for N; BF16_Optimizer engines load the same
files. From a reader that streams, each rank's flat partitions are laid out of the source's spans
(``ucp.targets.blocks.stream``) and the module's weights are cast one parameter at a time as the
file is written, so memory holds no rank's share; other readers (a tensor-parallel view: this runs
once per TP rank MM on that rank's view) read each parameter once into every rank's buffers.

A param group is one flat tensor partitioned over all N ranks, unless the plan gives it sets of
members (``NativePlan.zero12_sets``: a MoE run's expert groups, each expert-parallel rank holding its
own experts): then each set is its own flat tensor over N / S ranks, and every rank file takes, per
group, the partition of the set it holds, so one pass writes every rank's whole file.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ucp.deepspeed import states as ds_states
from ucp.deepspeed.layout import model_file, optim_file
from ucp.io.pool import parallel_map, typical_state_bytes
from ucp.io.torchpickle import UnsharedDict
from ucp.model.partition import Span, Zero12Group, round_robin_order, zero12_group
from ucp.model.pieces import Pieces
from ucp.model.records import PieceState, Reader, torch_dtype
from ucp.targets.blocks.common import RankBuffers
from ucp.targets.blocks.stream import (
    Located,
    Weight,
    flat_pieces,
    locate,
    module_weight,
    read_weight,
    refuse_fp16_overflow,
)
from ucp.targets.blocks.zero12 import fill_zero12_ranks, group_steps, zero12_buffers
from ucp.targets.native.common import model_states, module_of, optimizer_groups, save_rank_file, zero_wrapper
from ucp.targets.native.plan import NativePlan, Share, param_step

__all__ = ["write_zero12"]

logger = logging.getLogger(__name__)

Flat = torch.Tensor | Pieces


def write_zero12(reader: Reader, plan: NativePlan, tag_dir: Path, workers: int, share: Share = Share()) -> None:
    """Write TP rank ``plan.mp_rank``'s files of a stage-1/2 checkpoint for ``plan.dp`` ranks into
    ``tag_dir`` (under a ``share``, the files it names: per TP rank, unit 0 is the model file and
    unit 1 + r rank r's optim file, TP rank m's units following TP rank m - 1's)."""
    if plan.dtype == "fp16":
        refuse_fp16_overflow(reader, [m.name for m in reader.facts.params])
    files = _Zero12Files(reader, plan, tag_dir)
    base = plan.mp_rank * (plan.dp + 1)
    model = share.mine(base)
    ranks = [r for r in range(plan.dp) if share.mine(base + 1 + r)]
    if reader.streams:
        # source files are checked from the bytes the rank files copied
        with reader.deferred_checks(share.elsewhere if share.checked is not None else None):
            _write_streaming(files, workers, model, ranks)
    else:
        _write_buffered(files, workers, model, ranks)
    logger.debug("wrote a ZeRO-%d checkpoint for dp=%d to %s", plan.stage, plan.dp, tag_dir)


def _write_streaming(files: _Zero12Files, workers: int, model: bool, ranks: list[int]) -> None:
    """Check every parameter once, then write the model file and the ranks' files from the spans."""
    reader, plan = files.reader, files.plan
    facts = reader.facts
    members = [[(n, facts.param(n).numel) for n in flat.names] for flat in files.flats]
    located = locate(
        reader,
        members,
        files.keys,
        moments=files.moments,
        workers=workers,
        step_of=lambda state: param_step(plan, state),
        unit="ZeRO-1/2 param group",
    )
    files.settle(located.steps)
    lp = torch_dtype(plan.dtype)
    if model:
        files.write_model({name: module_weight(state, lp) for name, state in located.states.items()})

    def one(rank: int) -> None:
        fp32, optim = _rank_pieces(files, located, rank)
        files.write_rank(rank, fp32, optim, [located.scalars[f] for f, _ in files.held(rank)])

    grain = typical_state_bytes(reader.facts, moments=files.moments)  # a rank's file is cut from every parameter
    threads = max(1, min(workers, len(ranks)))
    for _ in parallel_map(one, ranks, threads, desc="write", weight=files.rank_bytes, grain=grain):
        pass


def _rank_pieces(files: _Zero12Files, located: Located, rank: int) -> tuple[list[Flat], list[dict[str, Flat]]]:
    """Rank ``rank``'s flat partition of each param group (and of each state key) as pieces."""
    fp32: list[Flat] = []
    optim: list[dict[str, Flat]] = []
    for f, part in files.held(rank):
        layout = files.flats[f].layout
        states = [located.states[name] for name in files.flats[f].names]
        spans = [(i, span) for i in range(len(states)) for span in layout.spans(i) if span.rank == part]

        fp32.append(_cut(layout.partition_size, spans, states, None))
        whole = files.whole[f]
        slots = layout.whole_slots(part) if whole else {}
        optim.append(
            {
                key: flat_pieces(layout.whole_size(part), [(o, states[i].optim[key]) for i, o in slots.items()])
                if key in whole
                else _cut(layout.partition_size, spans, states, key)
                for key in files.keys[f]
            }
        )
    return fp32, optim


def _cut(size: int, spans: list[tuple[int, Span]], states: list[PieceState], key: str | None) -> Pieces:
    """One rank's partition of a flat group (the fp32 masters, or state ``key``) from its members' spans."""
    placed = []
    for i, span in spans:
        source = states[i].fp32 if key is None else states[i].optim[key]
        placed.append((span.partition_start, source.slice(span.param_start, span.param_start + span.length)))
    return flat_pieces(size, placed)


def _write_buffered(files: _Zero12Files, workers: int, model: bool, ranks: list[int]) -> None:
    """Read every parameter once into the ranks' partitions, then write the files rank by rank."""
    reader, plan = files.reader, files.plan
    lp = torch_dtype(plan.dtype)
    weights: dict[str, Weight] = {}

    def keep_weight(name: str, state: PieceState) -> None:
        weights[name] = state.fp32.join(lp)

    scalars: list[dict[str, torch.Tensor]] = [{} for _ in files.flats]
    filled = {r: files.buffers(r, scalars) for r in ranks}
    seen = fill_zero12_ranks(
        reader,
        [flat.layout for flat in files.flats],
        [flat.names for flat in files.flats],
        files.by_partition(filled, scalars),
        keys=files.keys,
        moments=files.moments,
        workers=workers,
        step_of=lambda state: param_step(plan, state),
        on_state=keep_weight,
        whole=files.whole,
    )
    files.settle(seen)
    if model:
        files.write_model(weights)
    for r in ranks:
        buffers = filled.pop(r)
        files.write_rank(r, buffers.fp32, buffers.optim, buffers.scalars)


@dataclass(frozen=True)
class _Flat:
    """One flat tensor of the checkpoint: a param group's members (or one set of them) over ``layout.dp`` ranks."""

    group: int
    names: list[str]  # the reader's names, in flat order
    labels: list[str]  # the names the rank files give them
    layout: Zero12Group


class _Zero12Files:
    """What every file of one TP rank shares (flat layouts, groups, steps), and the writing of each."""

    def __init__(self, reader: Reader, plan: NativePlan, tag_dir: Path) -> None:
        self.reader, self.plan, self.tag_dir = reader, plan, tag_dir
        facts = reader.facts
        self.flats: list[_Flat] = []
        self.sets: list[list[int]] = []  # per param group: its flats, set by set
        for g, names in enumerate(plan.group_names):
            pairs = _member_sets(g, names, plan)
            self.sets.append(list(range(len(self.flats), len(self.flats) + len(pairs))))
            for members, labels in pairs:
                # DeepSpeed keeps frozen parameters and trainable ones with zero elements outside the flat
                # groups (0.19.8 ``is_optimized_parameter``)
                kept = [i for i, n in enumerate(members) if facts.param(n).numel > 0]
                ranks = plan.dp // len(pairs)
                if plan.round_robin:
                    kept = [kept[k] for k in round_robin_order(len(kept), ranks)]
                layout = zero12_group([facts.param(members[i]).numel for i in kept], ranks)
                self.flats.append(_Flat(g, [members[i] for i in kept], [labels[i] for i in kept], layout))
        kept_names = {n for flat in self.flats for n in flat.names}
        self.outside = [m.name for m in facts.params if m.name not in kept_names]
        # members of a group cut in sets live in files of their own (a MoE run's expert files)
        self.apart = {n for sets in plan.zero12_sets.values() for names in sets.names for n in names}
        self.moments = not plan.reset_moments
        self.keys = [facts.groups[flat.group].state_keys if self.moments else () for flat in self.flats]
        whole = plan.whole_keys(facts) if self.moments else []
        self.whole = [whole[flat.group] if flat.group < len(whole) else () for flat in self.flats]
        self.config = ds_states.config_for_stage(facts.info.ds_config, plan.stage, round_robin=plan.round_robin)
        self.wrapper = zero_wrapper(reader, plan)
        self.clip_grad = ds_states.clip_grad(reader.extras(), facts.info.ds_config, facts.info.ds_version)
        self.steps: list[int] = []
        self.groups: list[dict] = []

    def held(self, rank: int) -> list[tuple[int, int]]:
        """Per param group, the flat rank ``rank`` holds a partition of, and which partition."""
        return [(flats[rank % len(flats)], rank // len(flats)) for flats in self.sets]

    def rank_bytes(self, rank: int) -> int:
        """About how many bytes rank ``rank``'s optim file holds (the progress bar's weight)."""
        return sum(4 * self.flats[f].layout.partition_size * (1 + len(self.keys[f])) for f, _ in self.held(rank))

    def buffers(self, rank: int, scalars: list[dict[str, torch.Tensor]]) -> RankBuffers:
        """Rank ``rank``'s zeroed partitions, per param group; ``scalars`` per flat, shared by the ranks."""
        held = self.held(rank)
        return zero12_buffers(
            [self.flats[f].layout for f, _ in held],
            [self.keys[f] for f, _ in held],
            [scalars[f] for f, _ in held],
            rank=rank,
            whole=[self.whole[f] for f, _ in held],
            partitions=[part for _, part in held],
        )

    def by_partition(
        self, filled: Mapping[int, RankBuffers], scalars: list[dict[str, torch.Tensor]]
    ) -> dict[int, RankBuffers]:
        """The ranks' buffers as ``fill_zero12_ranks`` fills them: per partition index, per flat
        (partition p of the flat of set k of S is rank p * S + k's). A partition whose rank is not
        being written (under a Share) gets a scratch buffer; past a flat's partitions, an empty one."""
        views: dict[int, RankBuffers] = {}
        wanted = sorted({part for rank in filled for _, part in self.held(rank)})
        for part in wanted:
            fp32: list[torch.Tensor] = []
            optim: list[dict[str, torch.Tensor]] = []
            for flats in self.sets:
                for k, f in enumerate(flats):
                    rank = part * len(flats) + k
                    if rank in filled:
                        g = self.flats[f].group
                        fp32.append(filled[rank].fp32[g])
                        optim.append(filled[rank].optim[g])
                        continue
                    layout = self.flats[f].layout if part < self.flats[f].layout.dp else zero12_group([], 1)
                    scratch = zero12_buffers([layout], [self.keys[f]], [{}], rank=part, whole=[self.whole[f]])
                    fp32.append(scratch.fp32[0])
                    optim.append(scratch.optim[0])
            views[part] = RankBuffers(fp32, optim, scalars)
        return views

    def settle(self, seen: list[set[int]]) -> None:
        """One step per param group (ZeRO-1/2 steps a group as one flat tensor; ``seen`` is per flat), and
        the groups."""
        self.steps = group_steps([set().union(*(seen[f] for f in flats)) for flats in self.sets])
        self.groups = optimizer_groups(self.reader, self.plan, [[g] for g in range(len(self.sets))], self.steps)

    def write_model(self, weights: Mapping[str, Weight]) -> None:
        """``mp_rank_MM_model_states.pt``: the module in the run's dtype, frozen parameters included."""
        reader, plan = self.reader, self.plan
        facts = reader.facts
        lp = torch_dtype(plan.dtype)
        frozen: OrderedDict[str, Weight] = OrderedDict((n, read_weight(reader, n, lp)) for n in self.outside)
        module = module_of(reader, {**frozen, **weights}, apart=self.apart)
        shapes = {n: torch.Size(facts.param(n).shape) for n in frozen}
        frozen_states = (
            ds_states.frozen_fields(shapes, frozen, excluded=facts.info.frozen_excluded)
            if plan.stage == 2
            else {"frozen_param_shapes": None, "frozen_param_fragments": None}  # stage 1: frozen weights in the module
        )
        states = model_states(
            reader,
            plan,
            extra={
                "param_shapes": [  # rank 0's, as DeepSpeed saves them
                    UnsharedDict(
                        (label, torch.Size(facts.param(n).shape))
                        for n, label in zip(self.flats[f].names, self.flats[f].labels)
                    )
                    for f, _ in self.held(0)
                ],
                "frozen_param_shapes": frozen_states["frozen_param_shapes"],
                "shared_params": dict(facts.tied),
                "frozen_param_fragments": frozen_states["frozen_param_fragments"],
            },
        )
        states["module"] = module
        states["ds_config"] = self.config
        states.update(plan.model_fields)
        save_rank_file(states, self.tag_dir / model_file(plan.mp_rank))

    def write_rank(
        self,
        rank: int,
        fp32: Sequence[Flat],
        optim: Sequence[Mapping[str, Flat]],
        scalars: Sequence[Mapping[str, torch.Tensor]],
    ) -> None:
        """``*zero_pp_rank_R_mp_rank_MM_optim_states.pt`` for DP rank ``rank``."""
        plan, facts = self.plan, self.reader.facts
        held = self.held(rank)
        block = ds_states.zero12_optim_block(
            wrapper=self.wrapper,
            flavour=plan.flavour,
            fp32=fp32,
            optim=optim,
            scalars=scalars,
            layouts=[self.flats[f].layout for f, _ in held],
            names=[self.flats[f].labels for f, _ in held],
            index=rank,
            partitions=[part for _, part in held],
            steps=self.steps,
            groups=self.groups,
            clip_grad=self.clip_grad,
            ds_version=facts.info.ds_version,
            moments=self.moments,
        )
        save_rank_file(
            ds_states.optim_file_dict(block, self.config, facts.info.ds_version),
            self.tag_dir / optim_file(rank, plan.mp_rank, bf16=plan.dtype == "bf16"),
        )


def _member_sets(g: int, names: list[str], plan: NativePlan) -> list[tuple[Sequence[str], Sequence[str]]]:
    """Param group g's sets of (members, labels): one set of all its members unless the plan cuts it."""
    sets = plan.zero12_sets.get(g)
    if sets is None:
        return [(names, names)]
    if plan.dp % sets.count:
        raise ValueError(f"param group {g} is cut in {sets.count} sets, which do not divide dp={plan.dp}")
    if sorted(n for members in sets.names for n in members) != sorted(names):
        raise ValueError(f"the sets of param group {g} do not hold exactly its members")
    return list(zip(sets.names, sets.labels))
