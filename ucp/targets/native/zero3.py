"""The native ZeRO-3 writer: per-rank model-states and optim-states files for ``plan.dp`` ranks.

From a reader that streams (a universal directory, a ZeRO-1/2/3 checkpoint) every rank file is
written straight from the source's spans (``ucp.targets.blocks.stream``): memory holds spans and
metadata, and rank files are written in parallel. Other readers (a transformed or tensor-parallel
view, DeepSpeed's own universal folders) read each parameter once into every rank's buffers.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed import states as ds_states
from ucp.deepspeed.layout import optim_file, zero3_model_file
from ucp.errors import InputError
from ucp.io.pool import parallel_map
from ucp.model.partition import Zero3Layout, zero3_partition_size, zero3_rank_span
from ucp.model.pieces import Pieces
from ucp.model.records import Reader, torch_dtype
from ucp.targets.blocks.stream import flat_pieces, locate
from ucp.targets.blocks.zero3 import fill_ranks, sub_group_keys, sub_group_steps
from ucp.targets.native.common import model_states, optimizer_groups, save_rank_file, zero_wrapper
from ucp.targets.native.plan import NativePlan, Share, param_step

__all__ = ["write_zero3"]

logger = logging.getLogger(__name__)

Flat = torch.Tensor | Pieces


def write_zero3(reader: Reader, plan: NativePlan, tag_dir: Path, workers: int, share: Share = Share()) -> None:
    """Write every rank's two files of a ZeRO-3 checkpoint for ``plan.dp`` ranks into ``tag_dir``
    (under a ``share``, the ranks it names: unit k is rank k's files)."""
    layout = plan.layout
    if layout is None:
        raise InputError("a ZeRO-3 plan carries its layout")  # plan_native always sets it at stage 3
    keys = sub_group_keys(reader, layout, moments=not plan.reset_moments)
    writer = _Zero3Files(reader, plan, layout, tag_dir)
    ranks = [r for r in range(plan.dp) if share.mine(r)]
    if reader.streams:
        # source files are checked from the bytes the rank files copied
        with reader.deferred_checks(share.elsewhere if share.checked is not None else None):
            _write_streaming(writer, keys, workers, ranks)
    else:
        _write_buffered(writer, keys, workers, ranks)
    logger.debug("wrote a ZeRO-3 checkpoint for dp=%d to %s", plan.dp, tag_dir)


def _write_streaming(writer: _Zero3Files, keys: list[tuple[str, ...]], workers: int, ranks: list[int]) -> None:
    """Check every parameter once, then write the ranks' files in parallel from the source's spans."""
    reader, plan, layout = writer.reader, writer.plan, writer.layout
    members: list[list[tuple[str, int]]] = [[] for _ in layout.sub_group_numel]
    for g, names in enumerate(plan.group_names):
        for i, name in enumerate(names):
            slot = layout.slots[g][i]
            members[slot.sub_group].append((name, slot.numel))
    located = locate(
        reader,
        members,
        keys,
        moments=not plan.reset_moments,
        workers=workers,
        step_of=lambda state: param_step(plan, state),
        unit="ZeRO-3 sub-group",
    )
    writer.settle(located.steps)

    def one(rank: int) -> None:
        placed: list[list[tuple[str | None, int, Pieces]]] = [[] for _ in layout.sub_group_numel]
        for g, names in enumerate(plan.group_names):
            for i, name in enumerate(names):
                slot = layout.slots[g][i]
                start, end = zero3_rank_span(slot.numel, layout.dp, rank)
                if end <= start:
                    continue
                state = located.states[name]
                placed[slot.sub_group].append((None, slot.offset, state.fp32.slice(start, end)))
                for key, pieces in state.optim.items():
                    placed[slot.sub_group].append((key, slot.offset, pieces.slice(start, end)))
        fp32 = [flat_pieces(size, [(o, p) for k, o, p in placed[s] if k is None]) for s, size in _sizes(layout)]
        optim = [
            {key: flat_pieces(size, [(o, p) for k, o, p in placed[s] if k == key]) for key in keys[s]}
            for s, size in _sizes(layout)
        ]
        writer.write_rank(rank, fp32, optim, located.scalars)

    size = sum(4 * numel * (1 + len(k)) for numel, k in zip(layout.sub_group_numel, keys))  # one rank's file
    for _ in parallel_map(one, ranks, max(1, min(workers, len(ranks))), desc="write", weight=lambda r: size):
        pass


def _write_buffered(writer: _Zero3Files, keys: list[tuple[str, ...]], workers: int, ranks: list[int]) -> None:
    """Read every parameter once into the ranks' buffers, then write rank by rank."""
    reader, plan = writer.reader, writer.plan
    filled, seen = fill_ranks(
        reader,
        writer.layout,
        plan.group_names,
        ranks,
        keys=keys,
        moments=not plan.reset_moments,
        workers=workers,
        step_of=lambda state: param_step(plan, state),
    )
    writer.settle(seen)
    for rank in ranks:
        buffers = filled.pop(rank)
        writer.write_rank(rank, buffers.fp32, buffers.optim, buffers.scalars)
        del buffers  # this rank's buffers go before the next is written


def _sizes(layout: Zero3Layout) -> list[tuple[int, int]]:
    return list(enumerate(layout.sub_group_numel))


class _Zero3Files:
    """What every rank's files share (param shapes, groups, steps), and the writing of one rank's."""

    def __init__(self, reader: Reader, plan: NativePlan, layout: Zero3Layout, tag_dir: Path) -> None:
        self.reader, self.plan, self.layout, self.tag_dir = reader, plan, layout, tag_dir
        facts = reader.facts
        self.frozen = [m for m in facts.params if m.frozen]
        self.param_shapes: list[OrderedDict] = [OrderedDict() for _ in layout.sub_group_numel]
        for g, names in enumerate(plan.group_names):
            for i, name in enumerate(names):
                self.param_shapes[layout.slots[g][i].sub_group][name] = torch.Size(facts.param(name).shape)
        self.wrapper = zero_wrapper(reader, plan)
        self.steps: list[int] = []
        self.groups: list[dict] = []

    def settle(self, seen: list[set[int]]) -> None:
        """One step per sub-group from its members', and the param groups that carry them."""
        self.steps = sub_group_steps(seen)
        members = [self.layout.sub_groups_in(g) for g in range(len(self.plan.group_names))]
        group_steps = [max((self.steps[s] for s in subs), default=0) for subs in members]
        self.groups = optimizer_groups(self.reader, self.plan, members, group_steps)

    def write_rank(
        self,
        rank: int,
        fp32: Sequence[Flat],
        optim: Sequence[Mapping[str, Flat]],
        scalars: Sequence[Mapping[str, torch.Tensor]],
    ) -> None:
        plan, facts = self.plan, self.reader.facts
        frozen = ds_states.frozen_fields(
            {m.name: torch.Size(m.shape) for m in self.frozen},
            self._frozen_fragments(rank),
            excluded=facts.info.frozen_excluded,
        )
        states = model_states(
            self.reader,
            plan,
            extra={
                "param_shapes": self.param_shapes,
                "frozen_param_shapes": frozen["frozen_param_shapes"],
                "shared_params": dict(facts.tied),
                "frozen_param_fragments": frozen["frozen_param_fragments"],
            },
        )
        save_rank_file(states, self.tag_dir / zero3_model_file(rank, plan.mp_rank))
        block = ds_states.zero3_optim_block(
            wrapper=self.wrapper,
            flavour=plan.flavour,
            fp32=fp32,
            optim=optim,
            scalars=scalars,
            steps=self.steps,
            groups=self.groups,
            dp=plan.dp,
            moments=not plan.reset_moments,
        )
        save_rank_file(
            ds_states.optim_file_dict(block, facts.info.ds_config, facts.info.ds_version),
            self.tag_dir / optim_file(rank, plan.mp_rank, bf16=plan.dtype == "bf16"),
        )

    def _frozen_fragments(self, rank: int) -> dict[str, Any]:
        """This rank's padded share of each frozen parameter, in the run's dtype (read one at a time)."""
        dp, lp = self.plan.dp, torch_dtype(self.plan.dtype)
        fragments: dict[str, Any] = OrderedDict()
        for meta in self.frozen:
            start, end = zero3_rank_span(meta.numel, dp, rank)
            fragment = torch.zeros(zero3_partition_size(meta.numel, dp), dtype=lp)
            with self.reader.read_pieces(meta.name, moments=False) as state:
                state.fp32.slice(start, end).copy_to(fragment.narrow(0, 0, end - start))
            fragments[meta.name] = fragment
        return fragments
