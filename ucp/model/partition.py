"""Pure partition maths: which rank holds which elements of which parameter. No I/O, no torch.

ZeRO-3 partitions every parameter on its own: rank r holds elements
``[r*P, min((r+1)*P, numel))`` of the flattened parameter, where ``P = ceil(numel / dp)``, padded
with zeros to P. Each rank concatenates its partitions, parameter by parameter in param-group
order, into flat "sub-group" buffers; a new sub-group starts once the running partition size
reaches ``sub_group_size`` (DeepSpeed 0.19.8, ``_create_fp16_sub_groups``).

ZeRO-1/2 flatten a whole param group (its trainable, non-empty parameters in order, no gaps
unless ``parameter_alignment`` asks for them), pad the flat buffer at the end to a multiple of
``A = 2 * dp`` elements (``nccl_start_alignment_factor`` 2 times the DP size, for every dtype), and
cut it into ``dp`` equal partitions of ``S = T / dp``. A parameter can straddle ranks; the padding
sits at the end, where it can cover whole trailing ranks (DeepSpeed 0.19.8, ``stage_1_and_2.py``
and ``bf16_optimizer.py``; proven bit-exact on real checkpoints). With ``round_robin_gradients`` a
group's members enter the flat buffer in round-robin order over the DP ranks (:func:`round_robin_order`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "ceil_div",
    "zero3_partition_size",
    "zero3_rank_span",
    "zero3_sub_groups",
    "Zero3Slot",
    "Zero3Layout",
    "zero3_layout",
    "Span",
    "ZERO12_ALIGNMENT",
    "zero12_padded_numel",
    "zero12_partition_size",
    "zero12_group_padding",
    "zero12_param_spans",
    "zero12_rank_slice",
    "zero12_whole_slots",
    "Zero12Group",
    "zero12_group",
    "round_robin_order",
]


def ceil_div(a: int, b: int) -> int:
    if b <= 0:
        raise ValueError(f"divisor must be positive, got {b}")
    return -(-a // b)


def zero3_partition_size(numel: int, dp: int) -> int:
    """Elements each of ``dp`` ranks holds for one ZeRO-3 parameter, padding included."""
    return ceil_div(numel, dp)


def zero3_rank_span(numel: int, dp: int, rank: int) -> tuple[int, int]:
    """[start, end) of the real (unpadded) elements of the flattened parameter that ``rank`` holds."""
    size = zero3_partition_size(numel, dp)
    start = min(rank * size, numel)
    return start, min(start + size, numel)


def zero3_sub_groups(partition_sizes: Sequence[int], sub_group_size: int | None) -> list[list[int]]:
    """Split one param group's parameters (given by partition size) into sub-groups, as indices.

    Mirrors DeepSpeed: a sub-group closes once its running size reaches ``sub_group_size`` or at
    the group's last parameter; the whole group is one sub-group when it fits.
    """
    total = sum(partition_sizes)
    if not partition_sizes:
        return []
    if sub_group_size is None or sub_group_size >= total:
        return [list(range(len(partition_sizes)))]
    groups: list[list[int]] = []
    current: list[int] = []
    running = 0
    for index, size in enumerate(partition_sizes):
        current.append(index)
        running += size
        if running >= sub_group_size or index == len(partition_sizes) - 1:
            groups.append(current)
            current, running = [], 0
    return groups


@dataclass(frozen=True, slots=True)
class Zero3Slot:
    """Where one parameter's partition sits in every rank's flat sub-group buffer."""

    group: int  # param group index
    sub_group: int  # global sub-group index (the optimizer state key)
    offset: int  # element offset inside the sub-group's flat buffer
    size: int  # partition size (padding included)
    numel: int  # real elements of the whole parameter


@dataclass(frozen=True)
class Zero3Layout:
    """The flat layout of a ZeRO-3 run at one DP size: slots per parameter, sizes per sub-group."""

    dp: int
    slots: tuple[tuple[Zero3Slot, ...], ...]  # [param group][param]
    sub_group_numel: tuple[int, ...]  # per global sub-group, per rank
    sub_group_of_group: tuple[int, ...]  # param group of each sub-group
    counts: tuple[int, ...] = ()  # per param group, the ranks it is partitioned over (empty: dp each)

    def sub_groups_in(self, group: int) -> list[int]:
        return [i for i, g in enumerate(self.sub_group_of_group) if g == group]

    def partition_count(self, group: int) -> int:
        """How many ranks share param group ``group``: dp, or fewer for an expert group (AutoEP)."""
        return self.counts[group] if self.counts else self.dp


def zero3_layout(
    numels: Sequence[Sequence[int]], dp: int, sub_group_size: int | None, counts: Sequence[int] | None = None
) -> Zero3Layout:
    """The layout DeepSpeed builds for param groups with these parameter sizes at this DP size; ``counts[g]``:
    the ranks group g is partitioned over when not all ``dp`` (an AutoEP expert group's W / E, 0.19.8
    ``partition_numel`` over the expert-data-parallel group: sub-groups are cut by that size too)."""
    if dp <= 0:
        raise ValueError(f"dp must be positive, got {dp}")
    if counts is not None and (len(counts) != len(numels) or any(c <= 0 or dp % c for c in counts)):
        raise ValueError(f"partition counts {list(counts)} must be one per param group, each dividing dp={dp}")
    slots: list[tuple[Zero3Slot, ...]] = []
    sub_numel: list[int] = []
    sub_group_of_group: list[int] = []
    for group, group_numels in enumerate(numels):
        count = dp if counts is None else counts[group]
        sizes = [zero3_partition_size(n, count) for n in group_numels]
        group_slots: list[Zero3Slot | None] = [None] * len(sizes)
        for members in zero3_sub_groups(sizes, sub_group_size):
            sub = len(sub_numel)
            offset = 0
            for index in members:
                group_slots[index] = Zero3Slot(group, sub, offset, sizes[index], group_numels[index])
                offset += sizes[index]
            sub_numel.append(offset)
            sub_group_of_group.append(group)
        slots.append(tuple(s for s in group_slots if s is not None))
    return Zero3Layout(
        dp, tuple(slots), tuple(sub_numel), tuple(sub_group_of_group), tuple(counts) if counts is not None else ()
    )


@dataclass(frozen=True, slots=True)  # one per parameter and rank it reaches
class Span:
    """A run of elements of one parameter held by one rank's flat partition."""

    rank: int
    param_start: int  # offset into the flattened parameter
    partition_start: int  # offset into that rank's partition
    length: int


#: DeepSpeed's ``nccl_start_alignment_factor``: partitions start on 4-byte boundaries of 16-bit data.
ZERO12_ALIGNMENT = 2


def zero12_padded_numel(group_numel: int, dp: int, alignment: int = ZERO12_ALIGNMENT) -> int:
    """Flat group size ``T``: ``group_numel`` rounded up to a multiple of ``alignment * dp``."""
    if dp <= 0 or alignment <= 0:
        raise ValueError(f"dp and alignment must be positive, got dp={dp}, alignment={alignment}")
    unit = alignment * dp
    return ceil_div(group_numel, unit) * unit


def zero12_partition_size(group_numel: int, dp: int, alignment: int = ZERO12_ALIGNMENT) -> int:
    """Elements ``S`` of the flat group each rank holds, padding included."""
    return zero12_padded_numel(group_numel, dp, alignment) // dp


def zero12_group_padding(group_numel: int, dp: int, rank: int, alignment: int = ZERO12_ALIGNMENT) -> int:
    """Padding elements at the end of ``rank``'s partition (DeepSpeed's ``group_paddings[g]``)."""
    size = zero12_partition_size(group_numel, dp, alignment)
    left = rank * size
    if group_numel <= left:
        return size
    return max(0, left + size - group_numel)


def zero12_param_spans(param_offset: int, numel: int, partition_size: int, dp: int) -> list[Span]:
    """Cut the parameter at ``[param_offset, param_offset+numel)`` of a flat group into per-rank spans."""
    spans: list[Span] = []
    position = param_offset
    end = param_offset + numel
    while position < end:
        rank = position // partition_size
        if rank >= dp:
            raise ValueError(f"element {position} lies past {dp} partitions of {partition_size}")
        stop = min(end, (rank + 1) * partition_size)
        spans.append(Span(rank, position - param_offset, position - rank * partition_size, stop - position))
        position = stop
    return spans


def zero12_rank_slice(param_offset: int, numel: int, partition_size: int, rank: int) -> tuple[int, int] | None:
    """(start inside ``rank``'s partition, length) of the parameter's elements that rank holds, or None.

    This is DeepSpeed's ``param_slice_mappings`` entry (``fragment_address(start, numel)``).
    """
    left = rank * partition_size
    start = max(param_offset, left)
    end = min(param_offset + numel, left + partition_size)
    return (start - left, end - start) if start < end else None


def zero12_whole_slots(offsets: Sequence[int], numels: Sequence[int], partition_size: int, rank: int) -> dict[int, int]:
    """Where each parameter touching ``rank``'s partition sits in a buffer of *whole* parameters.

    DeepSpeed's Muon at ZeRO-1/2 (without optimizer offload) keeps, per rank, the momentum of every
    parameter whose elements reach the rank's partition, each whole and in flat order, one after
    the other: a parameter cut by a partition boundary is held whole by both ranks. The parameters
    are those of DeepSpeed's ``get_partition_info``: starting inside the partition, or starting
    before it and reaching into it. Returns {parameter index: offset in the buffer}.
    """
    left, right = rank * partition_size, (rank + 1) * partition_size
    slots: dict[int, int] = {}
    position = 0
    for index, (start, numel) in enumerate(zip(offsets, numels)):
        if left <= start < right or start < left < start + numel:
            slots[index] = position
            position += numel
    return slots


@dataclass(frozen=True)
class Zero12Group:
    """The flat layout of one ZeRO-1/2 param group at one DP size."""

    dp: int
    numels: tuple[int, ...]  # per parameter, flat order
    offsets: tuple[int, ...]  # element offset of each parameter in the flat group
    numel: int  # flat elements before the end padding (parameter-alignment gaps included)
    partition_size: int  # S: elements per rank, padding included

    def padding(self, rank: int) -> int:
        left = rank * self.partition_size
        if self.numel <= left:
            return self.partition_size
        return max(0, left + self.partition_size - self.numel)

    def spans(self, index: int) -> list[Span]:
        return zero12_param_spans(self.offsets[index], self.numels[index], self.partition_size, self.dp)

    def rank_slice(self, index: int, rank: int) -> tuple[int, int] | None:
        return zero12_rank_slice(self.offsets[index], self.numels[index], self.partition_size, rank)

    def whole_slots(self, rank: int) -> dict[int, int]:
        """Parameter index -> its offset in ``rank``'s whole-parameter buffer (see :func:`zero12_whole_slots`)."""
        return zero12_whole_slots(self.offsets, self.numels, self.partition_size, rank)

    def whole_size(self, rank: int) -> int:
        """Elements of ``rank``'s whole-parameter buffer."""
        return sum(self.numels[i] for i in self.whole_slots(rank))


def zero12_group(
    numels: Sequence[int], dp: int, *, param_paddings: Sequence[int] | None = None, alignment: int = ZERO12_ALIGNMENT
) -> Zero12Group:
    """The layout DeepSpeed builds for one param group with these parameter sizes (in flat order).

    ``param_paddings`` are the per-parameter gaps ``zero_optimization.parameter_alignment`` adds
    (DeepSpeed's ``param_alignment_paddings``); all zero by default.
    """
    if dp <= 0:
        raise ValueError(f"dp must be positive, got {dp}")
    paddings = list(param_paddings) if param_paddings is not None else [0] * len(numels)
    if len(paddings) != len(numels):
        raise ValueError(f"{len(paddings)} parameter paddings for {len(numels)} parameters")
    offsets = []
    position = 0
    for numel, pad in zip(numels, paddings):
        if numel < 0 or pad < 0:
            raise ValueError("parameter sizes and paddings must be non-negative")
        offsets.append(position)
        position += numel + pad
    return Zero12Group(dp, tuple(numels), tuple(offsets), position, zero12_partition_size(position, dp, alignment))


def round_robin_order(count: int, dp: int) -> list[int]:
    """The order ``zero_optimization.round_robin_gradients`` flattens a ZeRO-1/2 group's ``count`` members
    in at ``dp`` ranks: flat position k holds original member ``order[k]``. Members i with i % dp == 0 come
    first, then i % dp == 1, ... (DeepSpeed 0.19.8 ``_round_robin_reorder``), so the order changes with dp."""
    if dp <= 0 or count < 0:
        raise ValueError(f"round_robin_order needs dp > 0 and count >= 0, got dp={dp}, count={count}")
    return [i for start in range(min(dp, count)) for i in range(start, count, dp)]
