"""The partition maths on its own: tables from real DeepSpeed layouts, and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp.model.partition import (
    zero3_layout,
    zero3_partition_size,
    zero3_rank_span,
    zero3_sub_groups,
    zero12_group,
    zero12_group_padding,
    zero12_padded_numel,
    zero12_param_spans,
    zero12_partition_size,
    zero12_rank_slice,
)


@pytest.mark.parametrize(
    "numel, dp, expected",
    [(66, 2, 33), (42, 2, 21), (7, 2, 4), (49, 2, 25), (7, 4, 2), (1, 4, 1), (12, 3, 4), (13, 3, 5)],
)
def test_zero3_partition_size_is_ceil_split(numel, dp, expected):
    assert zero3_partition_size(numel, dp) == expected


@pytest.mark.parametrize(
    "numel, dp, rank, span",
    [
        (7, 2, 0, (0, 4)),
        (7, 2, 1, (4, 7)),
        (1, 4, 0, (0, 1)),
        (1, 4, 3, (1, 1)),
        (10, 4, 3, (9, 10)),
        (9, 4, 3, (9, 9)),
    ],
)
def test_zero3_rank_span_table(numel, dp, rank, span):
    assert zero3_rank_span(numel, dp, rank) == span


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_zero3_spans_tile_the_parameter_exactly_once(numel, dp):
    covered = []
    for rank in range(dp):
        start, end = zero3_rank_span(numel, dp, rank)
        assert 0 <= end - start <= zero3_partition_size(numel, dp)
        covered.extend(range(start, end))
    assert covered == list(range(numel))


def test_sub_groups_close_when_running_size_reaches_limit():
    # seen in a real DeepSpeed 0.19.8 run: sub_group_size=50, partitions 33 and 21 close a sub-group together
    assert zero3_sub_groups([33, 21, 4], 50) == [[0, 1], [2]]
    assert zero3_sub_groups([33, 21, 4], None) == [[0, 1, 2]]
    assert zero3_sub_groups([33, 21, 4], 58) == [[0, 1, 2]]
    assert zero3_sub_groups([60, 1, 1], 10) == [[0], [1, 2]]
    assert zero3_sub_groups([], 10) == []


@given(st.lists(st.integers(1, 500), min_size=1, max_size=30), st.integers(1, 2000))
def test_sub_groups_keep_order_and_every_member(sizes, limit):
    groups = zero3_sub_groups(sizes, limit)
    assert [i for g in groups for i in g] == list(range(len(sizes)))
    for g in groups[:-1]:
        assert sum(sizes[i] for i in g) >= limit


def test_layout_offsets_are_cumulative_partitions_per_sub_group():
    layout = zero3_layout([[66, 42], [7]], dp=2, sub_group_size=50)
    assert layout.sub_group_numel == (54, 4)
    assert layout.sub_group_of_group == (0, 1)
    assert [(s.sub_group, s.offset, s.size) for s in layout.slots[0]] == [(0, 0, 33), (0, 33, 21)]
    assert [(s.sub_group, s.offset, s.size) for s in layout.slots[1]] == [(1, 0, 4)]


@given(st.integers(1, 5000), st.integers(1, 16), st.integers(1, 8))
def test_zero12_spans_cover_parameter_in_order(numel, dp, alignment):
    total = zero12_padded_numel(numel + 3, dp, alignment)
    assert total % (dp * alignment) == 0 and total >= numel + 3
    spans = zero12_param_spans(3, numel, total // dp, dp)
    assert sum(s.length for s in spans) == numel
    assert [s.param_start for s in spans] == sorted(s.param_start for s in spans)


# group numel, dp -> (partition size, group_paddings per rank), read off real DeepSpeed 0.19.8 files
@pytest.mark.parametrize(
    "numel, dp, size, paddings",
    [
        (86, 3, 30, [0, 0, 4]),  # 23,10,23,10,10,10: the worked example
        (920, 3, 308, [0, 0, 4]),
        (370, 3, 124, [0, 0, 2]),
        (1376, 3, 460, [0, 0, 4]),
        (1290, 2, 646, [0, 2]),
        (370, 2, 186, [0, 2]),
        (86, 4, 22, [0, 0, 0, 2]),
        (370, 4, 94, [0, 0, 0, 6]),
        (1290, 1, 1290, [0]),
    ],
)
def test_zero12_partitions_align_to_twice_dp_and_pad_at_the_end(numel, dp, size, paddings):
    assert zero12_partition_size(numel, dp) == size
    assert zero12_padded_numel(numel, dp) % (2 * dp) == 0
    assert [zero12_group_padding(numel, dp, r) for r in range(dp)] == paddings


def test_zero12_padding_can_cover_whole_trailing_ranks():
    assert zero12_partition_size(3, 4) == 2
    assert [zero12_group_padding(3, 4, r) for r in range(4)] == [0, 1, 2, 2]
    assert zero12_partition_size(7, 1) == 8 and zero12_group_padding(7, 1, 0) == 1


def test_zero12_group_worked_example_slices_match_param_slice_mappings():
    layout = zero12_group([23, 10, 23, 10, 10, 10], 3)
    assert (layout.partition_size, layout.offsets) == (30, (0, 23, 33, 56, 66, 76))
    assert [layout.rank_slice(i, 1) for i in range(6)] == [None, (0, 3), (3, 23), (26, 4), None, None]
    assert [layout.rank_slice(i, 2) for i in range(6)] == [None, None, None, (0, 6), (6, 10), (16, 10)]
    assert [layout.padding(r) for r in range(3)] == [0, 0, 4]
    assert [(s.rank, s.param_start, s.partition_start, s.length) for s in layout.spans(3)] == [
        (1, 0, 26, 4),
        (2, 4, 0, 6),
    ]


def test_zero12_group_keeps_parameter_alignment_gaps():
    layout = zero12_group([5, 3, 4], 2, param_paddings=[3, 1, 0])
    assert layout.offsets == (0, 8, 12) and layout.numel == 16 and layout.partition_size == 8


@given(st.lists(st.integers(0, 400), min_size=1, max_size=12), st.integers(1, 9))
def test_zero12_every_element_lands_on_exactly_one_rank_once(numels, dp):
    layout = zero12_group(numels, dp)
    held = [[0] * layout.partition_size for _ in range(dp)]
    for i, numel in enumerate(numels):
        covered = []
        for rank in range(dp):
            where = layout.rank_slice(i, rank)
            if where is not None:
                start, length = where
                for k in range(start, start + length):
                    held[rank][k] += 1
                covered.append((rank, start, length))
        assert [(s.rank, s.partition_start, s.length) for s in layout.spans(i)] == covered
        assert sum(length for _, _, length in covered) == numel
    for rank in range(dp):
        used = layout.partition_size - layout.padding(rank)
        assert held[rank] == [1] * used + [0] * layout.padding(rank)
    assert zero12_rank_slice(0, 0, layout.partition_size, 0) is None


@settings(deadline=None)  # the first example imports DeepSpeed
@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=8),
    st.integers(1, 5),
    st.one_of(st.none(), st.lists(st.integers(0, 3), min_size=8, max_size=8)),
)
def test_zero12_whole_slots_are_deepspeeds_params_in_partition(numels, dp, paddings):
    """Muon's whole-parameter layout takes DeepSpeed's own get_partition_info as its truth (0.19.8)."""
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    pads = paddings[: len(numels)] if paddings is not None else None
    layout = zero12_group(numels, dp, param_paddings=pads)
    tensors = [torch.empty(n) for n in numels]
    for rank in range(dp):
        held, _, _ = DeepSpeedZeroOptimizer.get_partition_info(None, tensors, layout.partition_size, rank, pads)
        slots = layout.whole_slots(rank)
        assert [id(tensors[i]) for i in slots] == [id(t) for t in held]
        assert list(slots.values()) == [sum(numels[j] for j in list(slots)[:k]) for k in range(len(slots))]
        assert layout.whole_size(rank) == sum(t.numel() for t in held)
