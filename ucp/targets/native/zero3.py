"""The native ZeRO-3 writer: per-rank model-states and optim-states files for ``plan.dp`` ranks.

From a reader that streams (a universal directory, a ZeRO-1/2/3 checkpoint) the rank files are written parameter by
parameter: every parameter is checked once (``ucp.targets.blocks.stream.locate``, which settles steps and scalars),
then the ranks are cut into tasks of contiguous ranks (as many as the threads it runs, one for small parameters as
``ucp.io.pool`` decides; at most :data:`RANKS_PER_TASK` ranks each, so the descriptors stay bounded at any DP); a
task lays out its ranks' optim-states files with their flat tensors reserved (``ucp.io.torchzip.lay_out``), reads
each parameter's range for its ranks once, and writes each rank's slice into that rank's file through a gathering
buffer (``ucp.io.record_fill``). A universal file is read once per task instead of once per rank (at 10^5
parameters and DP 8: 3 x 10^5 reads instead of 2.4 M), and memory holds the parameter in hand plus the spans the
check kept (at most :data:`KEEP_PARTS`), never every parameter's. Other readers (a transformed or tensor-parallel
view, DeepSpeed's own universal folders) read each parameter once into every rank's buffers.

A param group the plan cuts in sets (``NativePlan.zero12_sets``: an AutoEP expert group, each expert-parallel
rank holding its own experts) is partitioned over each set's ranks only, as DeepSpeed 0.19.8 partitions it over
the expert-data-parallel group; its optim files then say so in ``ds_zero_partition_groups``.
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed import states as ds_states
from ucp.deepspeed.autoep import PARTITION_GROUPS, partition_group_entry
from ucp.deepspeed.layout import optim_file, zero3_model_file
from ucp.deepspeed.states import Flat
from ucp.errors import InputError
from ucp.io.descriptors import reserve
from ucp.io.memory import give_back_freed
from ucp.io.pool import parallel_map, threads_for, typical_state_bytes
from ucp.io.read_ahead import ReadAhead
from ucp.io.record_fill import RecordFill
from ucp.io.span_copy import read_witnessed
from ucp.io.torchpickle import Pickled, UnsharedDict, pickle_object
from ucp.io.torchzip import LaidFile, lay_out, write_pickled
from ucp.model.partition import Zero3Layout, Zero3Slot, zero3_partition_size, zero3_rank_span
from ucp.model.pieces import Pieces, Reserved
from ucp.model.records import PieceState, Reader, torch_dtype
from ucp.targets.blocks.stream import Held, Located, copied_parts, locate, refuse_fp16_overflow
from ucp.targets.blocks.zero3 import fill_ranks, sub_group_keys, sub_group_steps
from ucp.targets.native.common import model_states, optimizer_groups, save_rank_file, zero_wrapper
from ucp.targets.native.plan import NativePlan, Share, param_step

__all__ = ["write_zero3"]

logger = logging.getLogger(__name__)

#: more model-states fields of one rank (an AutoEP rank's own ``ds_autoep_layers`` view)
RankFields = Callable[[int], Mapping[str, Any]]


def write_zero3(
    reader: Reader,
    plan: NativePlan,
    tag_dir: Path,
    workers: int,
    share: Share = Share(),
    rank_fields: RankFields | None = None,
) -> None:
    """Write every rank's two files of a ZeRO-3 checkpoint for ``plan.dp`` ranks into ``tag_dir``
    (under a ``share``, the ranks it names: unit k is rank k's files); ``rank_fields(r)``: rank r's own
    model-states fields, over the plan's ``model_fields``."""
    layout = plan.layout
    if layout is None:
        raise InputError("a ZeRO-3 plan carries its layout")  # plan_native always sets it at stage 3
    if plan.dtype == "fp16":
        refuse_fp16_overflow(reader, [m.name for m in reader.facts.params])
    if plan.zero12_sets and not reader.streams:
        reader = Held(reader)  # sets are written from whole states, held once
    keys = sub_group_keys(reader, layout, moments=not plan.reset_moments)
    writer = _Zero3Files(reader, plan, layout, tag_dir, rank_fields)
    ranks = [r for r in range(plan.dp) if share.mine(r)]
    if reader.streams:
        # source files are checked from the bytes the rank files copied
        with reader.deferred_checks(share.elsewhere if share.checked is not None else None):
            _write_streaming(writer, keys, workers, ranks)
    else:
        _write_buffered(writer, keys, workers, ranks)
    logger.debug("wrote a ZeRO-3 checkpoint for dp=%d to %s", plan.dp, tag_dir)


#: ranks one task lays out and fills at once (their optim-states files stay open until filled)
RANKS_PER_TASK = 128
#: bytes a task gathers, over all its open records (one buffer per rank and flat tensor of a sub-group)
FILL_BUDGET = 4 << 20
_FILL_MIN = 32 << 10
#: the pieces' parts (spans of source files) the check keeps for the tasks, in all: a parameter past it is read again
#: by each task (cheap for a universal file; for a ZeRO-3 source saved at DP 4096, 4096 spans to find per state)
KEEP_PARTS = 1 << 18
#: a parameter's range for a task's ranks up to this many bytes is read into memory once and cut there; a larger one
#: is copied rank slice by rank slice straight from its files
GATHER_MAX = 8 << 20
#: the bytes of the windows over the source's rank files (``ucp.io.read_ahead``), shared by the tasks running at once
READ_AHEAD = 32 << 20


def _write_streaming(writer: _Zero3Files, keys: list[tuple[str, ...]], workers: int, ranks: list[int]) -> None:
    """Check every parameter once, then write the ranks' files parameter by parameter, in tasks of contiguous ranks:
    a task lays out its ranks' files, then reads each parameter's range for those ranks once and writes each rank's
    slice of it into that rank's file (at 10^5 parameters, one read per parameter and state instead of one per rank
    too, and memory that holds the spans of a bounded number of parameters past their turn)."""
    reader, plan, layout = writer.reader, writer.plan, writer.layout
    members: list[list[tuple[str, int]]] = [[] for _ in layout.sub_group_numel]
    for name, slot in _slots(plan, layout):
        members[slot.sub_group].append((name, slot.numel))
    located = locate(
        reader,
        members,
        keys,
        moments=not plan.reset_moments,
        workers=workers,
        step_of=lambda state: param_step(plan, state),
        unit="ZeRO-3 sub-group",
        keep=KEEP_PARTS,
    )
    writer.settle(located.steps)
    # per sub-group, its members in offset order, each (group, index) packed in one word (a tuple each: 7 MB at 10^5)
    order: list[array[int]] = []
    for packed in _members(layout):
        packed.sort(key=lambda gi: layout.slots[gi >> 32][gi & _LOW].offset)
        order.append(array("q", packed))
    # a task walks every parameter, so its grain is a parameter's, and one thread takes as few tasks as it can
    workers = threads_for(workers, typical_state_bytes(reader.facts, moments=not plan.reset_moments))
    count = min(len(ranks), max(workers, -(-len(ranks) // RANKS_PER_TASK)))
    tasks = [ranks[t * len(ranks) // count : (t + 1) * len(ranks) // count] for t in range(count)]
    reserve(min(len(ranks), workers * max(map(len, tasks), default=0)), "a ZeRO-3 save")

    threads = max(1, min(workers, len(tasks)))

    def one(task: list[int]) -> None:
        _RankTask(writer, keys, located, order, task, ahead=ReadAhead(READ_AHEAD // threads)).write()
        give_back_freed()

    size = sum(4 * numel * (1 + len(k)) for numel, k in zip(layout.sub_group_numel, keys))  # one rank's file
    for _ in parallel_map(one, tasks, threads, desc="write", weight=lambda t: size * len(t)):
        pass


_LOW = (1 << 32) - 1


def _members(layout: Zero3Layout) -> list[list[int]]:
    """Each sub-group's members as ``group << 32 | index``."""
    members: list[list[int]] = [[] for _ in layout.sub_group_numel]
    for g, slots in enumerate(layout.slots):
        for i, slot in enumerate(slots):
            members[slot.sub_group].append(g << 32 | i)
    return members


class _RankTask:
    """The files of a few contiguous ranks, laid out first and then filled parameter by parameter."""

    def __init__(
        self,
        writer: _Zero3Files,
        keys: list[tuple[str, ...]],
        located: Located,
        order: list[array[int]],
        ranks: list[int],
        *,
        ahead: ReadAhead,
    ) -> None:
        self.writer, self.keys, self.order, self.ranks = writer, keys, order, ranks
        self.scalars, self.kept = located.scalars, located.states
        self.moments = not writer.plan.reset_moments
        self.gathered = torch.empty(0, dtype=torch.uint8)  # a parameter's range for these ranks, reused
        self.ahead = ahead  # windows over the source's rank files, read forward member by member

    def write(self) -> None:
        writer, layout = self.writer, self.writer.layout
        laid: dict[int, LaidFile] = {}
        # rank -> per sub-group: the masters' record, then each state key's
        records: dict[int, list[dict[str | None, Reserved]]] = {}
        try:
            for rank in self.ranks:
                writer.write_model(rank)
                flats = [
                    {None: Reserved(numel, torch.float32), **{k: Reserved(numel, torch.float32) for k in self.keys[s]}}
                    for s, numel in _sizes(layout)
                ]
                laid[rank] = lay_out(writer.optim_pickled(rank, flats, self.scalars), writer.optim_path(rank))
                records[rank] = flats
            crcs: dict[int, dict[Reserved, int]] = {rank: {} for rank in self.ranks}
            for s, numel in _sizes(layout):
                for rank, key, crc in self._fill_sub_group(s, numel, laid, records):
                    crcs[rank][records[rank][s][key]] = crc
            for rank in self.ranks:
                laid.pop(rank).finish(crcs[rank])
        finally:
            for file in laid.values():
                file.close()

    def _fill_sub_group(
        self, s: int, numel: int, laid: dict[int, LaidFile], records: dict[int, list[dict[str | None, Reserved]]]
    ) -> Iterator[tuple[int, str | None, int]]:
        """Sub-group ``s``'s flat tensors of every rank, member after member; yields (rank, key, crc32) of each."""
        plan, layout = self.writer.plan, self.writer.layout
        keys: list[str | None] = [None, *self.keys[s]]
        per = max(_FILL_MIN, FILL_BUDGET // (len(self.ranks) * len(keys)) // 4096 * 4096)
        buffer = memoryview(bytearray(per * len(self.ranks) * len(keys)))
        fills: dict[tuple[int, str | None], RecordFill] = {}
        for r, rank in enumerate(self.ranks):
            for k, key in enumerate(keys):
                offset, nbytes = laid[rank].holes[records[rank][s][key]]
                at = (r * len(keys) + k) * per
                fills[rank, key] = RecordFill(laid[rank].fd, offset, nbytes, buffer[at : at + per])
        for gi in self.order[s]:
            g, i = gi >> 32, gi & _LOW
            slot = layout.slots[g][i]
            holders: dict[str, list[tuple[int, int, int]]] = {}  # name -> (rank, start, end) of its slices
            for rank in self.ranks:
                names, _, part = _held(plan, g, rank)
                start, end = zero3_rank_span(slot.numel, layout.partition_count(g), part)
                if end > start:
                    holders.setdefault(names[i], []).append((rank, start, end))
            for name, held in holders.items():
                with self._state(name) as state:
                    for key in keys:
                        pieces = state.fp32 if key is None else state.optim[key]
                        self._scatter(pieces, slot.offset * 4, [(fills[rank, key], a, b) for rank, a, b in held])
        for (rank, key), fill in fills.items():
            fill.zeros_to(numel * 4)  # the padding after the last member
            yield rank, key, fill.close()

    @contextmanager
    def _state(self, name: str) -> Iterator[PieceState]:
        """A member's pieces: those the check kept, else read again."""
        kept = self.kept.get(name)
        if kept is not None:
            yield kept
            return
        with self.writer.reader.read_pieces(name, moments=self.moments) as state:
            yield state

    def _scatter(self, pieces: Pieces, at: int, slices: list[tuple[RecordFill, int, int]]) -> None:
        """Each rank's slice ``[a, b)`` of a member's flat tensor into its record, at byte ``at``: read once for all
        of them when the range fits :data:`GATHER_MAX`, else copied slice by slice from the files."""
        low, high = min(a for _, a, _ in slices), max(b for _, _, b in slices)
        if (high - low) * 4 <= GATHER_MAX:
            nbytes = (high - low) * 4
            if self.gathered.numel() < nbytes:
                self.gathered = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8)
            view = memoryview(self.gathered.numpy()).cast("B")[:nbytes]  # type: ignore[arg-type]
            read_witnessed(pieces.slice(low, high).parts, view, self.ahead)
            for fill, a, b in slices:
                fill.zeros_to(at)
                fill.put(view[(a - low) * 4 : (b - low) * 4])
        else:
            for fill, a, b in slices:
                fill.zeros_to(at)
                fill.copy(copied_parts(pieces.slice(a, b)))


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


def _held(plan: NativePlan, g: int, rank: int) -> tuple[Sequence[str], Sequence[str], int]:
    """Param group g's members ``rank`` holds (the reader's names, the files' names) and its partition of them."""
    sets = plan.zero12_sets.get(g)
    if sets is None:
        return plan.group_names[g], plan.group_names[g], rank
    index, part = sets.held(rank)
    return sets.names[index], sets.labels[index], part


def _slots(plan: NativePlan, layout: Zero3Layout) -> Iterator[tuple[str, Zero3Slot]]:
    """Every member of every set with its slot (a set's i-th member sits where every set's i-th does)."""
    for g, names in enumerate(plan.group_names):
        sets = plan.zero12_sets.get(g)
        for members in sets.names if sets is not None else (names,):
            for i, name in enumerate(members):
                yield name, layout.slots[g][i]


class _Zero3Files:
    """What every rank's files share (param shapes, groups, steps), and the writing of one rank's."""

    def __init__(
        self, reader: Reader, plan: NativePlan, layout: Zero3Layout, tag_dir: Path, rank_fields: RankFields | None
    ) -> None:
        self.reader, self.plan, self.layout, self.tag_dir = reader, plan, layout, tag_dir
        self.rank_fields = rank_fields
        self.frozen = [m for m in reader.facts.params if m.frozen]
        self.apart = {n for sets in plan.zero12_sets.values() for names in sets.names for n in names}
        self.config = plan.model_fields.get("ds_config") or ds_states.config_for_stage(
            reader.facts.info.ds_config, 3, zenflow=plan.transposed
        )
        self.wrapper = zero_wrapper(reader, plan)
        self.steps: list[int] = []
        self.groups: list[dict] = []
        self._lock = threading.Lock()
        self._shared_model: Pickled | None = None  # the model-states file every rank writes, when they agree
        # the optim-states object every rank pickles, and the records the first one reserved (optim_pickled)
        self._shared_optim: tuple[Pickled, list[dict[str | None, Reserved]]] | None = None

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
        self.write_model(rank)
        save_rank_file(self.optim_object(rank, fp32, optim, scalars), self.optim_path(rank))

    def write_model(self, rank: int) -> None:
        """Rank ``rank``'s model-states file."""
        path = self.tag_dir / zero3_model_file(rank, self.plan.mp_rank)
        if self.frozen or self.plan.zero12_sets or self.rank_fields is not None:  # each rank's file is its own
            save_rank_file(self._model_states(rank), path)
        else:  # every rank's file holds the same object (10^5 placeholders for 10^5 parameters): pickled once
            with self._lock:
                if self._shared_model is None:
                    self._shared_model = pickle_object(self._model_states(rank))
            write_pickled(self._shared_model, path)

    def optim_pickled(
        self, rank: int, flats: list[dict[str | None, Reserved]], scalars: Sequence[Mapping[str, torch.Tensor]]
    ) -> Pickled:
        """Rank ``rank``'s optim-states object pickled, its flat tensors left to fill (``flats``: per sub-group, the
        masters' record under None, then each state key's). Every rank's object is the same but for those records
        (unless ZeRO-1/2 partition groups make it the rank's own), so it is pickled once and each rank's records
        take the first one's places: building and pickling it per rank was a sixth of a DP 4096 restore."""
        if self.plan.zero12_sets:
            return pickle_object(self._optim_of(rank, flats, scalars))
        with self._lock:
            if self._shared_optim is None:
                self._shared_optim = pickle_object(self._optim_of(rank, flats, scalars)), flats
                return self._shared_optim[0]
        (data, records), first = self._shared_optim
        if [{k: r.numel for k, r in f.items()} for f in flats] != [{k: r.numel for k, r in f.items()} for f in first]:
            raise ValueError(f"rank {rank}'s optim-states records are not laid out as the first rank's")
        mine = {id(first[s][key]): hole for s, by_key in enumerate(flats) for key, hole in by_key.items()}
        return data, [(key, [mine.get(id(part), part) for part in parts]) for key, parts in records]

    def _optim_of(
        self, rank: int, flats: list[dict[str | None, Reserved]], scalars: Sequence[Mapping[str, torch.Tensor]]
    ) -> dict[str, Any]:
        fp32 = [f[None] for f in flats]
        optim = [{k: hole for k, hole in f.items() if k is not None} for f in flats]
        return self.optim_object(rank, fp32, optim, scalars)

    def optim_path(self, rank: int) -> Path:
        return self.tag_dir / optim_file(rank, self.plan.mp_rank, bf16=self.plan.dtype == "bf16")

    def optim_object(
        self,
        rank: int,
        fp32: Sequence[Flat],
        optim: Sequence[Mapping[str, Flat]],
        scalars: Sequence[Mapping[str, torch.Tensor]],
    ) -> dict[str, Any]:
        """Rank ``rank``'s optim-states file, its flat tensors as given (held, pieces, or reserved to fill later)."""
        plan, facts = self.plan, self.reader.facts
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
        if plan.zero12_sets:
            block[PARTITION_GROUPS] = self._partition_groups(rank)
        return ds_states.optim_file_dict(block, self.config, facts.info.ds_version)

    def _model_states(self, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s model-states file: empty placeholders, the param shapes, its frozen fragments."""
        plan, facts, layout = self.plan, self.reader.facts, self.layout
        param_shapes: list[OrderedDict] = [UnsharedDict() for _ in layout.sub_group_numel]
        for g in range(len(plan.group_names)):
            names, labels, _ = _held(plan, g, rank)
            for i, (name, label) in enumerate(zip(names, labels)):
                param_shapes[layout.slots[g][i].sub_group][label] = torch.Size(facts.param(name).shape)
        frozen = ds_states.frozen_fields(
            {m.name: torch.Size(m.shape) for m in self.frozen},
            self._frozen_fragments(rank),
            excluded=facts.info.frozen_excluded,
        )
        states = model_states(
            self.reader,
            plan,
            extra={
                "param_shapes": param_shapes,
                "frozen_param_shapes": frozen["frozen_param_shapes"],
                "shared_params": dict(facts.tied),
                "frozen_param_fragments": frozen["frozen_param_fragments"],
                "ds_config": self.config,
            },
        )
        for name in self.apart:  # in no module: DeepSpeed restores them from the optim files alone
            del states["module"][name]
        states.update(plan.model_fields)
        states.update(self.rank_fields(rank) if self.rank_fields is not None else {})
        return states

    def _partition_groups(self, rank: int) -> list[dict[str, Any]]:
        """``ds_zero_partition_groups`` as rank ``rank``'s engine records it. Only AutoEP expert groups are cut in
        sets at ZeRO-3 (legacy MoE refuses ZeRO-3)."""
        out = []
        for sub, g in enumerate(self.layout.sub_group_of_group):
            sets, dp = self.plan.zero12_sets.get(g), self.plan.dp
            if sets is None:
                ranks, part, family, name = list(range(dp)), rank, "replicated", "replicated"
            else:
                index, part = sets.held(rank)
                ranks, family, name = sets.ranks(index, dp), "autoep_expert", self.reader.facts.groups[g].raw["name"]
            out.append(partition_group_entry(sub, ranks, part, family, name))
        return out

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
