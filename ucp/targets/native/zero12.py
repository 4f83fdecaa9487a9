"""Universal (or any reader) -> a native ZeRO-1/2 checkpoint that stock DeepSpeed loads at DP=N.

Call order: ``ucp.targets.native.write_plan`` calls :func:`write_zero12` for stage 1 or 2 inside
its staged output folder. One ``mp_rank_MM_model_states.pt`` (the low-precision module, frozen
parameters and all) and N ``*zero_pp_rank_R_mp_rank_MM_optim_states.pt`` files are written with
every field DeepSpeedZeroOptimizer writes, recomputed for N; BF16_Optimizer engines load the same
files. From a reader that streams, each rank's flat partitions are laid out of the source's spans
(``ucp.targets.blocks.stream``) and the module's weights are cast one parameter at a time as the
file is written, so memory holds no rank's share; other readers (a tensor-parallel view: this runs
once per TP rank MM on that rank's view) read each parameter once into every rank's buffers.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed import states as ds_states
from ucp.deepspeed.layout import model_file, optim_file
from ucp.errors import InputError
from ucp.io.pool import parallel_map
from ucp.model.partition import Span, Zero12Group, zero12_group
from ucp.model.pieces import LazyTensor, Pieces
from ucp.model.records import ParamState, PieceState, Reader, torch_dtype
from ucp.targets.blocks.stream import Located, flat_pieces, locate
from ucp.targets.blocks.zero12 import fill_zero12_ranks, group_steps, zero12_buffers
from ucp.targets.native.common import model_states, optimizer_groups, save_rank_file, zero_wrapper
from ucp.targets.native.plan import NativePlan, Share, param_step

__all__ = ["write_zero12"]

logger = logging.getLogger(__name__)

Flat = torch.Tensor | Pieces
Weight = torch.Tensor | Pieces | LazyTensor


def write_zero12(reader: Reader, plan: NativePlan, tag_dir: Path, workers: int, share: Share = Share()) -> None:
    """Write TP rank ``plan.mp_rank``'s files of a stage-1/2 checkpoint for ``plan.dp`` ranks into
    ``tag_dir`` (under a ``share``, the files it names: per TP rank, unit 0 is the model file and
    unit 1 + r rank r's optim file, TP rank m's units following TP rank m - 1's)."""
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
    members = [[(n, facts.param(n).numel) for n in group] for group in files.names]
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
        files.write_model({name: _weight(state, lp) for name, state in located.states.items()})

    def one(rank: int) -> None:
        fp32, optim = _rank_pieces(files, located, rank)
        files.write_rank(rank, fp32, optim, located.scalars)

    size = sum(4 * layout.partition_size * (1 + len(k)) for layout, k in zip(files.layouts, files.keys))
    for _ in parallel_map(one, ranks, max(1, min(workers, len(ranks))), desc="write", weight=lambda r: size):
        pass


def _weight(state: PieceState, lp: torch.dtype) -> Weight:
    """A module weight from its fp32 master: the spans themselves in fp32, else cast when written."""
    master = state.fp32
    if lp == torch.float32:
        return master
    return LazyTensor(tuple(master.shape), lp, lambda: master.join(lp))


def _rank_pieces(files: _Zero12Files, located: Located, rank: int) -> tuple[list[Flat], list[dict[str, Flat]]]:
    """Rank ``rank``'s flat partition of each param group (and of each state key) as pieces."""
    fp32: list[Flat] = []
    optim: list[dict[str, Flat]] = []
    for g, layout in enumerate(files.layouts):
        states = [located.states[name] for name in files.names[g]]
        spans = [(i, span) for i in range(len(states)) for span in layout.spans(i) if span.rank == rank]

        fp32.append(_cut(layout.partition_size, spans, states, None))
        whole = files.whole[g] if g < len(files.whole) else ()
        slots = layout.whole_slots(rank) if whole else {}
        optim.append(
            {
                key: flat_pieces(layout.whole_size(rank), [(o, states[i].optim[key]) for i, o in slots.items()])
                if key in whole
                else _cut(layout.partition_size, spans, states, key)
                for key in files.keys[g]
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

    def keep_weight(name: str, state: ParamState) -> None:
        weights[name] = state.fp32.to(lp)

    scalars: list[dict[str, torch.Tensor]] = [{} for _ in files.layouts]
    filled = {r: zero12_buffers(files.layouts, files.keys, scalars, rank=r, whole=files.whole) for r in ranks}
    seen = fill_zero12_ranks(
        reader,
        files.layouts,
        files.names,
        filled,
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


class _Zero12Files:
    """What every file of one TP rank shares (flat layouts, groups, steps), and the writing of each."""

    def __init__(self, reader: Reader, plan: NativePlan, tag_dir: Path) -> None:
        self.reader, self.plan, self.tag_dir = reader, plan, tag_dir
        facts = reader.facts
        # DeepSpeed keeps frozen parameters and trainable ones with zero elements outside the flat
        # groups (0.19.8 ``is_optimized_parameter``)
        self.names = [[n for n in names if facts.param(n).numel > 0] for names in plan.group_names]
        kept = {n for names in self.names for n in names}
        self.outside = [m.name for m in facts.params if m.name not in kept]
        self.layouts: list[Zero12Group] = [
            zero12_group([facts.param(n).numel for n in group], plan.dp) for group in self.names
        ]
        self.moments = not plan.reset_moments
        self.keys = [facts.groups[g].state_keys if self.moments else () for g in range(len(self.names))]
        self.whole = plan.whole_keys(facts) if self.moments else []
        self.config = ds_states.config_for_stage(facts.info.ds_config, plan.stage)
        self.wrapper = zero_wrapper(reader, plan)
        self.clip_grad = ds_states.clip_grad(reader.extras(), facts.info.ds_config)
        self.steps: list[int] = []
        self.groups: list[dict] = []

    def settle(self, seen: list[set[int]]) -> None:
        """One step per param group (ZeRO-1/2 steps a group as one flat tensor), and the groups."""
        self.steps = group_steps(seen)
        self.groups = optimizer_groups(self.reader, self.plan, [[g] for g in range(len(self.names))], self.steps)

    def write_model(self, weights: Mapping[str, Weight]) -> None:
        """``mp_rank_MM_model_states.pt``: the module in the run's dtype, frozen parameters included."""
        reader, plan = self.reader, self.plan
        facts = reader.facts
        lp = torch_dtype(plan.dtype)
        frozen: OrderedDict[str, Weight] = OrderedDict((n, self._frozen(n, lp)) for n in self.outside)
        module: OrderedDict[str, Any] = OrderedDict()
        for meta in facts.params:
            module[meta.name] = weights[meta.name] if meta.name in weights else frozen[meta.name]
        for alias, owner in facts.tied.items():
            if owner not in module:
                raise InputError(f"tied parameter {alias!r} points at {owner!r}, which the checkpoint does not hold")
            module[alias] = module[owner]
        module.update(reader.buffers())
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
                "param_shapes": [
                    OrderedDict((n, torch.Size(facts.param(n).shape)) for n in group) for group in self.names
                ],
                "frozen_param_shapes": frozen_states["frozen_param_shapes"],
                "shared_params": dict(facts.tied),
                "frozen_param_fragments": frozen_states["frozen_param_fragments"],
            },
        )
        states["module"] = module
        states["ds_config"] = self.config
        save_rank_file(states, self.tag_dir / model_file(plan.mp_rank))

    def _frozen(self, name: str, lp: torch.dtype) -> Weight:
        """A parameter outside the flat groups, in the run's dtype: read when the file reaches it."""
        reader = self.reader
        shape = tuple(reader.facts.param(name).shape)
        if not reader.streams:
            return reader.read(name, moments=False).fp32.to(lp)
        return LazyTensor(shape, lp, lambda: reader.read(name, moments=False).fp32.to(lp).reshape(shape))

    def write_rank(
        self,
        rank: int,
        fp32: Sequence[Flat],
        optim: Sequence[Mapping[str, Flat]],
        scalars: Sequence[Mapping[str, torch.Tensor]],
    ) -> None:
        """``*zero_pp_rank_R_mp_rank_MM_optim_states.pt`` for DP rank ``rank``."""
        plan, facts = self.plan, self.reader.facts
        block = ds_states.zero12_optim_block(
            wrapper=self.wrapper,
            flavour=plan.flavour,
            fp32=fp32,
            optim=optim,
            scalars=scalars,
            layouts=self.layouts,
            names=self.names,
            index=rank,
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
