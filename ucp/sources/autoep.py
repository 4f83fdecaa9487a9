"""A DeepSpeed AutoEP checkpoint (0.19.8 ``expert_parallel``, ZeRO-1/2 or 3) -> one reader of the whole model,
every expert an ordinary parameter.

AutoEP keeps each layer's experts as fused tensors ``{module}.experts.w1/w2/w3`` of shape ``[L, ...]``, rank by
rank (:mod:`ucp.deepspeed.autoep` has the layout). The optim files partition them like the legacy MoE expert
groups, so the readers are the same: one :class:`~ucp.sources.zero12.Zero12Source` for the dense groups over
all files, one per expert-parallel rank for the expert groups over its expert-data-parallel files. Each local
fused tensor is then cut into its experts, each named by its **global** index as DeepSpeed's own expert files
name it: ``{module}.experts.w1.{e}`` of shape ``[...]``. An expert group lists, layer by layer and weight by
weight, experts ``0 .. n-1``: the flat order of the fused tensors at ep_size 1.

At ZeRO-3 the readers are :class:`~ucp.sources.zero3.Zero3Source`: the dense groups over every rank's files, the
expert groups of each expert-parallel rank over its expert-data-parallel ranks' files (which ranks those are, and
in which order, each rank's files say: ``ds_autoep_layers`` and ``ds_zero_partition_groups``). The experts and
their names are the same as at ZeRO-1/2.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace

from ucp.deepspeed.autoep import WEIGHTS, AutoEpLayer, autoep_layers, autoep_record, expert_name, rank_view
from ucp.deepspeed.fields import need_list, need_mapping
from ucp.deepspeed.layout import CheckpointFiles
from ucp.deepspeed.moe import ep_size, expert_ranks
from ucp.deepspeed.optim_states import optimizer_block
from ucp.errors import InputError
from ucp.io.torchfile import TorchFile, pickle_mentions
from ucp.model.layouts import SourceLayout
from ucp.model.pieces import Pieces
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, PieceState, Reader
from ucp.sources.format import How, Probe, SourceFormat
from ucp.sources.moe import MoeSource
from ucp.sources.zero3 import Zero3Source
from ucp.sources.zero12 import Zero12Source

__all__ = ["FORMAT", "AutoEpSource", "is_autoep"]

logger = logging.getLogger(__name__)

#: the ``extras`` entry (kept in the universal directory's state.pt) describing the AutoEP layers:
#: ``{"world": W, "ep_size": E, "layers": [{"layer", "module", "prefix", "experts", "ep_size", "shapes"}]}``


def is_autoep(files: CheckpointFiles) -> bool:
    """Whether the checkpoint was saved by AutoEP layers (its first model-states file lists them)."""
    path = files.model[0][0]
    if not pickle_mentions(path, "ds_autoep_layers"):  # most saves: no need to unpickle 10^5 placeholders
        return False
    with TorchFile(path) as tf:
        obj = tf.obj
        return isinstance(obj, dict) and obj.get("ds_autoep_layers") is not None


def _cut(pieces: Pieces, index: int, count: int, shape: tuple[int, ...]) -> Pieces:
    """Expert ``index`` of ``count`` fused along dim 0: a contiguous flat range, still without a copy."""
    size = pieces.numel // count
    part = pieces.slice(index * size, (index + 1) * size)
    return Pieces(part.parts, shape, part.dtype)


class AutoEpSource(MoeSource):
    """An AutoEP ZeRO-1/2 or ZeRO-3 checkpoint as a :class:`~ucp.model.records.Reader`.

    Call order: construct (reads ``ds_autoep_layers``, rank 0's param groups, the expert files' names (ZeRO-1/2)
    or each rank's view (ZeRO-3) and every reader's facts, then cuts the fused expert tensors into experts);
    ``read``/``read_pieces`` per parameter
    from any thread (an expert reads only its own slice of the fused tensor's spans); ``buffers``/``extras``;
    ``close``. ``autoep`` describes the layers (``extras()["autoep"]``, kept in state.pt).
    """

    def _build(self, optimizer: str | None) -> Facts:
        files = self.files
        if files.mp > 1:
            raise InputError(f"{files.tag_dir}: AutoEP with AutoTP folding ({files.mp} mp ranks) is not supported yet")
        with TorchFile(files.model[0][0]) as tf:
            layers = autoep_layers(need_mapping(tf.obj, tf.path.name), tf.path.name, zero3=files.stage3)
        if layers is None:
            raise InputError(f"{files.model[0][0].name} lists no ds_autoep_layers: not an AutoEP checkpoint")
        self._autoep_layers = layers
        if files.stage3:
            return self._build_zero3(optimizer)
        self._check_expert_files(layers)
        sizes, _ = self._heads()
        self._dense = Zero12Source(files, optimizer=optimizer, groups=[g for g, s in enumerate(sizes) if s is None])
        self._readers.append(self._dense)
        expert_groups = self._expert_groups(sizes)
        experts: list[Reader] = []
        for ep_rank in range(layers[0].ep_size):
            ranks = expert_ranks(files.dp, layers[0].ep_size, ep_rank)
            view = replace(files, optim=(tuple(files.optim[0][r] for r in ranks),))
            reader = Zero12Source(
                view,
                optimizer=optimizer,
                module={},  # the experts' weights are in their own files; the fp32 masters are read
                groups=expert_groups,
                head={"dp_world_size": files.dp // layers[0].ep_size},
            )
            self._readers.append(reader)
            experts.append(reader)
        return self._merge_autoep(experts, expert_groups)

    def _expert_groups(self, sizes: list[int | None]) -> list[int]:
        """The expert param groups (those with an ep size), all at the layers' ep size."""
        size = self._autoep_layers[0].ep_size
        expert_groups = [g for g, s in enumerate(sizes) if s is not None]
        if any(sizes[g] != size for g in expert_groups):
            raise InputError(f"{self.files.tag_dir}: expert param groups of another ep size than the layers' {size}")
        return expert_groups

    def _build_zero3(self, optimizer: str | None) -> Facts:
        """ZeRO-3: a dense reader over every rank, one expert reader per expert-parallel rank over its files."""
        files = self.files
        if files.experts:
            raise InputError(f"{files.tag_dir}: a ZeRO-3 AutoEP save holds no expert files, but this one has some")
        sizes = self._zero3_sizes()
        self._dense = Zero3Source(files, optimizer=optimizer, groups=[g for g, s in enumerate(sizes) if s is None])
        self._readers.append(self._dense)
        expert_groups = self._expert_groups(sizes)
        experts: list[Reader] = []
        for ranks in self._zero3_expert_ranks():
            view = replace(
                files,
                optim=(tuple(files.optim[0][r] for r in ranks),),
                model=(tuple(files.model[0][r] for r in ranks),),
            )
            reader = Zero3Source(view, optimizer=optimizer, groups=expert_groups, frozen=False)
            self._readers.append(reader)
            experts.append(reader)
        return self._merge_autoep(experts, expert_groups)

    def _zero3_sizes(self) -> list[int | None]:
        """Each optimizer param group's ep size (None: dense), from rank 0's ZeRO-3 optim file."""
        path = self.files.optim[0][0]
        with TorchFile(path) as tf:
            inner = need_mapping(optimizer_block(tf).get("optimizer_state_dict"), f"{path.name}: optimizer_state_dict")
            groups = need_list(inner.get("param_groups"), f"{path.name}: param_groups")
            return [ep_size(need_mapping(g, path.name), f"{path.name}: param group {i}") for i, g in enumerate(groups)]

    def _zero3_expert_ranks(self) -> list[list[int]]:
        """Per expert-parallel rank, its expert-data-parallel ranks in partition order, as each rank's model
        states say (0.19.8: ``p, p+E, ...``); Zero3Source checks the optim files agree."""
        size, world = self._autoep_layers[0].ep_size, self.files.dp
        if world % size:
            raise InputError(f"{self.files.tag_dir}: ep_size={size} does not divide the {world} rank files")
        slots: list[list[int | None]] = [[None] * (world // size) for _ in range(size)]
        for rank, path in enumerate(self.files.model[0]):
            with TorchFile(path) as tf:
                ep_rank, edp_rank = rank_view(need_mapping(tf.obj, path.name), path.name)
            if ep_rank >= size or edp_rank >= world // size or slots[ep_rank][edp_rank] is not None:
                raise InputError(
                    f"{path.name} says it is expert-parallel rank {ep_rank}, expert-data-parallel rank {edp_rank}: "
                    f"not a free slot of {world} ranks at ep_size={size}; files of different runs are mixed"
                )
            slots[ep_rank][edp_rank] = rank
        return [[r for r in ranks if r is not None] for ranks in slots]

    def _check_expert_files(self, layers: list[AutoEpLayer]) -> None:
        """Every layer's expert files present, each holding its expert's three slices under the global name."""
        found = {(layer, expert): path for layer, expert, _, path in self.files.experts}
        for x in layers:
            for e in range(x.experts):
                path = found.pop((x.layer, e), None)
                if path is None:
                    raise InputError(f"{self.files.tag_dir}: AutoEP layer {x.layer} ({x.module}) lacks expert file {e}")
                with TorchFile(path) as tf:
                    names = {str(k) for k in need_mapping(tf.obj, path.name)}
                want = {expert_name(x.prefix, w, e) for w in WEIGHTS}
                if names != want:
                    raise InputError(f"{path.name} should hold {sorted(want)}; it holds {sorted(names)[:4]}")
        if found:
            layer, expert = min(found)
            raise InputError(f"{found[layer, expert].name}: no AutoEP layer {layer} with expert {expert}")

    def _merge_autoep(self, experts: Sequence[Reader], expert_groups: list[int]) -> Facts:
        """The dense reader's facts, each fused expert tensor of each expert group cut into its experts."""
        head = self._dense.facts
        fused = {x.fused(w): (x, w) for x in self._autoep_layers for w in WEIGHTS}
        self._slices: dict[str, tuple[Reader, str, int, int, tuple[int, ...]]] = {}
        groups: list[GroupMeta] = []
        params: list[ParamMeta] = []
        warnings = list(head.warnings)
        for g, meta in enumerate(head.groups):
            if g not in expert_groups:
                self._owner.update(dict.fromkeys(meta.params, self._dense))
                params += [head.param(n) for n in meta.params]
                groups.append(meta)
                continue
            metas = [r.facts.groups[g] for r in experts]
            if len({tuple(m.params) for m in metas}) != 1:
                raise InputError(f"param group {g} lists other fused expert tensors on different expert ranks")
            names: list[str] = []
            for local in metas[0].params:
                if local not in fused:
                    raise InputError(f"{local} is in an expert param group but no ds_autoep_layers entry holds it")
                layer, weight = fused[local]
                shape = layer.shapes[weight]
                for ep_rank, reader in enumerate(experts):
                    have = reader.facts.param(local)
                    if have.shape != (layer.local, *shape[1:]):
                        raise InputError(
                            f"{local} on expert-parallel rank {ep_rank} has shape {list(have.shape)}, but "
                            f"ds_autoep_layers gives [{layer.local}, {', '.join(map(str, shape[1:]))}]"
                        )
                for e in range(layer.experts):
                    ep_rank, j = divmod(e, layer.local)
                    name = expert_name(layer.prefix, weight, layer.placement[ep_rank][j])
                    self._slices[name] = (experts[ep_rank], local, j, layer.local, tuple(shape[1:]))
                    names.append(name)
                    params.append(replace(experts[0].facts.param(local), name=name, shape=tuple(shape[1:])))
            steps = {m.step for m in metas}
            if len(steps) > 1:
                warnings.append(f"param group {g} has different steps across expert ranks: {sorted(map(str, steps))}")
            if len({m.state_keys for m in metas}) > 1:
                raise InputError(f"param group {g} keeps other optimizer state on different expert ranks")
            step = max((s for s in steps if s is not None), default=None)
            groups.append(replace(metas[0], params=names, step=step))
        frozen = [p for p in head.params if p.frozen]
        self._owner.update(dict.fromkeys((p.name for p in frozen), self._dense))
        untrained = sorted(set(fused) - {local for _, local, *_ in self._slices.values()})
        if untrained:
            raise InputError(f"{untrained[0]} is an AutoEP expert tensor no optimizer group trains: not supported yet")
        layout = SourceLayout("autoep", autoep_record(self._autoep_layers, head.info.dp_world_size))
        step_values = [g.step for g in groups if g.step is not None]
        return replace(
            head,
            groups=groups,
            params=params + frozen,
            step=max(step_values, default=None),
            warnings=warnings,
            layout=layout,
        )

    # -- tensors -----------------------------------------------------------------------------
    @contextmanager
    def read_pieces(self, name: str, *, moments: bool = True) -> Iterator[PieceState]:
        cut = self._slices.get(name)
        if cut is None:
            with self._reader(name).read_pieces(name, moments=moments) as state:
                yield state
            return
        reader, local, j, count, shape = cut
        with reader.read_pieces(local, moments=moments) as state:
            yield PieceState(
                fp32=_cut(state.fp32, j, count, shape),
                optim={k: _cut(v, j, count, shape) for k, v in state.optim.items()},
                step=state.step,
                scalars=dict(state.scalars),
            )

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        if name not in self._slices:
            return self._reader(name).read(name, moments=moments)
        with self.read_pieces(name, moments=moments) as state:
            return state.joined()


def _claims_autoep(probe: Probe) -> bool:
    files = probe.deepspeed
    return files is not None and not files.layers and probe.autoep


def _open_autoep(probe: Probe, how: How) -> Reader:
    assert probe.deepspeed is not None  # claimed
    return AutoEpSource(probe.deepspeed, optimizer=how.optimizer)


FORMAT = SourceFormat(
    name="deepspeed-autoep",
    label="DeepSpeed AutoEP checkpoint (expert_parallel)",
    docs="format.md#expert-parallelism-autoep-0198-expert_parallel-config",
    claims=_claims_autoep,
    open=_open_autoep,
    family="deepspeed",
)
