"""A ZeRO-1/2 rank's partitions are filled from a universal directory by reading only the slices that rank holds
(``ucp.targets.blocks.zero12.fill_zero12_ranks``, which a live ``ucp.restore(engine)`` and the native writer's
buffered path use): no parameter is ever read whole, so a live rank restoring a 4 GB embedding holds its partition
of it, not the tensor; and the partitions are exactly the slices of the whole tensors."""

from __future__ import annotations

import pytest
import torch

import ucp
from tests.support.fixtures import refuse_in_fast_tier
from ucp.model.partition import zero12_group
from ucp.model.pieces import Pieces
from ucp.model.steps import step_chooser
from ucp.targets.blocks.zero12 import fill_zero12_ranks, zero12_buffers


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 2])
def test_a_rank_reads_only_its_slices_and_gets_exactly_them(universals, monkeypatch, rank: int) -> None:
    refuse_in_fast_tier("a real ZeRO-2 checkpoint converted to universal")
    dp = 3
    with ucp.open_reader(universals("z2-bf16-dp3-adamw")) as reader:
        facts = reader.facts
        names = [[p.name for p in facts.params if p.group == g.index] for g in facts.groups]
        layouts = [zero12_group([facts.param(n).numel for n in group], dp) for group in names]
        keys = [("exp_avg", "exp_avg_sq") for _ in names]
        whole = {n: reader.read(n) for group in names for n in group}  # the expectation, read before the ban
        mine = zero12_buffers(layouts, keys, [{} for _ in layouts], rank=rank)

        def never(*args, **kwargs):
            raise AssertionError("a whole tensor was read")

        monkeypatch.setattr(Pieces, "join", never)  # no span joined whole
        monkeypatch.setattr(type(reader), "read", never)  # no parameter read whole
        fill_zero12_ranks(
            reader, layouts, names, {rank: mine}, keys=keys, moments=True, workers=2, step_of=step_chooser("keep")
        )
    for g, group in enumerate(names):
        for i, name in enumerate(group):
            for span in layouts[g].spans(i):
                if span.rank != rank:
                    continue
                cut = slice(span.param_start, span.param_start + span.length)
                held = slice(span.partition_start, span.partition_start + span.length)
                assert torch.equal(mine.fp32[g][held], whole[name].fp32.reshape(-1)[cut]), name
                for key in keys[g]:
                    assert torch.equal(mine.optim[g][key][held], whole[name].optim[key].reshape(-1)[cut]), (name, key)
