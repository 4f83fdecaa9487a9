"""A legacy DeepSpeed mixture-of-experts checkpoint (``deepspeed.moe.layer.MoE``, ZeRO-1/2) -> one reader of
the whole model, every expert an ordinary parameter.

The optim files hold two kinds of param groups (:mod:`ucp.deepspeed.moe` has the layout): dense ones,
partitioned over every rank, and expert ones (``moe: True``), each rank holding its own experts under local
names, partitioned over its expert-data-parallel group. One :class:`~ucp.sources.zero12.Zero12Source` reads
the dense groups over all the files; one per expert-parallel rank reads the expert groups over that rank's
files, giving each expert its **global** name, the one DeepSpeed's expert files use:
``{module}.deepspeed_moe.experts.deepspeed_experts.{e}.{name}`` with ``e`` in ``0 .. num_experts-1``. An
expert group keeps its settings and lists every expert of every rank, in global order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from ucp.deepspeed.fields import build_facts, need_list, need_mapping
from ucp.deepspeed.layout import CheckpointFiles
from ucp.deepspeed.moe import EXPERT_INFIX, ep_size, expert_name, expert_order, expert_parts, expert_ranks
from ucp.deepspeed.optim_states import optimizer_block
from ucp.errors import InputError
from ucp.io.torchfile import TorchFile
from ucp.model.layouts import SourceLayout
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, PieceState, Reader
from ucp.sources.format import How, Probe, SourceFormat
from ucp.sources.zero12 import Zero12Source

__all__ = ["FORMAT", "MoeSource"]

logger = logging.getLogger(__name__)

#: the ``extras`` entry (kept in the universal directory's state.pt) describing the MoE layers:
#: ``{"layers": [{"layer", "module", "experts", "ep_size"}], "world": W}``


class MoeSource(Reader):
    """A legacy MoE ZeRO-1/2 checkpoint as a :class:`~ucp.model.records.Reader`.

    Call order: construct (reads rank 0's param groups, the expert files' names and every reader's facts,
    then merges them); ``read``/``read_pieces`` per parameter from any thread (each goes to the reader
    holding it); ``buffers``/``extras``; ``close``. ``moe`` describes the layers for ``ucp inspect``.
    """

    streams = True

    def __init__(self, files: CheckpointFiles, *, optimizer: str | None = None) -> None:
        self.files = files
        # a subclass's readers may be ZeRO-3 ones (AutoEP); only the Reader interface is used
        self._readers: list[Reader] = []
        self._owner: dict[str, Reader] = {}
        self._dense: Reader
        self.facts = build_facts(
            lambda: self._build(optimizer),
            close=self.close,
            where=f"{files.tag_dir}: the files are not a mixture-of-experts checkpoint ucp can read",
        )

    # -- facts -------------------------------------------------------------------------------
    def _heads(self) -> tuple[list[int | None], list[list[str]]]:
        """Each optimizer param group's expert-parallel size (None: a dense group), from rank 0's optim
        file, and its members as ``param_shapes`` names them (an expert group: rank 0's local experts)."""
        path = self.files.optim[0][0]
        with TorchFile(path) as tf:
            base = need_mapping(optimizer_block(tf).get("base_optimizer_state"), f"{path.name}: base_optimizer_state")
            groups = [
                need_mapping(g, f"{path.name}: a param group") for g in need_list(base.get("param_groups"), path.name)
            ]
            sizes = [ep_size(g, f"{path.name}: param group {i}") for i, g in enumerate(groups)]
        model = self.files.model[0][0]
        with TorchFile(model) as tf:
            shapes = need_list(need_mapping(tf.obj, model.name).get("param_shapes"), f"{model.name}: param_shapes")
            names = [list(need_mapping(g, f"{model.name}: param_shapes entry")) for g in shapes]
        if len(names) != len(sizes):
            raise InputError(f"{model.name} lists {len(names)} param groups, {path.name} {len(sizes)}")
        return sizes, names

    def _layers(self) -> dict[str, dict[str, Any]]:
        """MoE module -> its layer index and expert count, from the expert files, which must name each
        expert's parameters under the file's global index, every layer's experts 0..n-1 present."""
        found: dict[int, dict[int, str]] = {}
        self._expert_files: dict[str, set[str]] = {}
        for layer, expert, _, path in self.files.experts:
            with TorchFile(path) as tf:
                names = {str(k) for k in need_mapping(tf.obj, path.name)}
            parts = [expert_parts(n) for n in names]
            modules = {p[0] for p in parts if p is not None}
            if not names or len(modules) != 1 or any(p is None or p[1] != expert for p in parts):
                raise InputError(
                    f"{path.name} should hold the parameters of expert {expert} of one MoE module "
                    f"(<module>{EXPERT_INFIX}{expert}.<name>); it holds {sorted(names)[:4]}"
                )
            found.setdefault(layer, {})[expert] = modules.pop()
            self._expert_files[path.name] = names
        out: dict[str, dict[str, Any]] = {}
        for layer, experts in sorted(found.items()):
            if sorted(experts) != list(range(len(experts))):
                missing = min(set(range(max(experts) + 1)) - set(experts))
                raise InputError(f"{self.files.tag_dir}: the expert files of layer {layer} lack expert {missing}")
            modules = set(experts.values())
            if len(modules) != 1 or next(iter(modules)) in out:
                raise InputError(
                    f"{self.files.tag_dir}: MoE layer {layer}'s expert files name modules {sorted(modules)}"
                )
            out[modules.pop()] = {"layer": layer, "experts": len(experts)}
        return out

    def _build(self, optimizer: str | None) -> Facts:
        files = self.files
        if files.stage3:
            raise InputError(f"{files.tag_dir}: a ZeRO-3 MoE checkpoint; ucp reads legacy MoE runs at ZeRO-1/2")
        if files.mp > 1:
            raise InputError(f"{files.tag_dir}: MoE with tensor parallelism ({files.mp} mp ranks) is not supported yet")
        sizes, shapes = self._heads()
        self._moe_layers = self._layers()
        self._dense = Zero12Source(files, optimizer=optimizer, groups=[g for g, s in enumerate(sizes) if s is None])
        self._readers.append(self._dense)
        experts: dict[int, list[Reader]] = {}
        for size in sorted({s for s in sizes if s is not None}):
            groups = [g for g, s in enumerate(sizes) if s == size]
            for ep_rank in range(size):
                view = replace(files, optim=(tuple(files.optim[0][r] for r in expert_ranks(files.dp, size, ep_rank)),))
                rename = self._rename([n for g in groups for n in shapes[g]], size, ep_rank)
                reader = Zero12Source(
                    view,
                    optimizer=optimizer,
                    module={},  # the experts' weights are in their own files; the fp32 masters are read
                    groups=groups,
                    rename=rename,
                    head={"dp_world_size": files.dp // size},
                )
                self._readers.append(reader)
                for g in groups:
                    experts.setdefault(g, []).append(reader)
        facts = self._merge(experts)
        for file, names in self._expert_files.items():
            extra = sorted(names - set(self._owner))
            if extra:
                raise InputError(
                    f"{file} holds {extra[0]}, which no optimizer group trains: frozen expert parameters and expert "
                    "buffers are not supported yet"
                )
        return facts

    def _rename(self, local: list[str], size: int, ep_rank: int) -> dict[str, str]:
        """Rank 0's local expert names -> expert-parallel rank ``ep_rank``'s global ones."""
        out = {}
        for name in local:
            parts = expert_parts(name)
            if parts is None or parts[0] not in self._moe_layers:
                raise InputError(
                    f"{name} is in a MoE param group, but no expert file holds its MoE module: files of different runs?"
                )
            module, index, rest = parts
            count = self._moe_layers[module]["experts"]
            self._moe_layers[module]["ep_size"] = size
            if count % size or index >= count // size:
                raise InputError(
                    f"{name}: local expert {index} of {module}, which has {count} experts at ep_size={size}: "
                    "files of different runs are mixed"
                )
            out[name] = expert_name(module, ep_rank * (count // size) + index, rest)
        return out

    def _merge(self, experts: Mapping[int, list[Reader]]) -> Facts:
        """The dense reader's facts, each expert group listing every expert-parallel rank's experts."""
        head = self._dense.facts
        groups: list[GroupMeta] = []
        params: list[ParamMeta] = []
        warnings = list(head.warnings)
        for g in range(len(head.groups)):
            readers = experts.get(g, [self._dense])
            metas = [r.facts.groups[g] for r in readers]
            for reader, m in zip(readers, metas):
                self._owner.update(dict.fromkeys(m.params, reader))
            names = [n for m in metas for n in m.params]
            names = names if readers == [self._dense] else expert_order(names)
            params += [self._owner[n].facts.param(n) for n in names]
            steps = {m.step for m in metas}
            if len(steps) > 1:
                warnings.append(f"param group {g} has different steps across expert ranks: {sorted(map(str, steps))}")
            keys = {m.state_keys for m in metas}
            if len(keys) > 1:
                raise InputError(
                    f"param group {g} keeps other optimizer state on different expert ranks: {sorted(keys)}"
                )
            step = max((s for s in steps if s is not None), default=None)
            groups.append(replace(metas[0], params=names, step=step))
        frozen = [p for p in head.params if p.frozen]
        for p in frozen:
            self._owner[p.name] = self._dense
        layers = [{"module": m, **v} for m, v in sorted(self._moe_layers.items(), key=lambda kv: kv[1]["layer"])]
        for layer in layers:
            if "ep_size" not in layer:
                raise InputError(f"{layer['module']} has expert files but no param group holds its experts")
        layout = SourceLayout("moe", {"world": head.info.dp_world_size, "layers": layers})
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
    def _reader(self, name: str) -> Reader:
        reader = self._owner.get(name)
        if reader is None:
            raise InputError(f"parameter {name!r} is not in this checkpoint")
        return reader

    @contextmanager
    def read_pieces(self, name: str, *, moments: bool = True) -> Iterator[PieceState]:
        with self._reader(name).read_pieces(name, moments=moments) as state:
            yield state

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        return self._reader(name).read(name, moments=moments)

    def buffers(self) -> dict[str, Any]:
        return self._dense.buffers()

    def extras(self) -> dict[str, Any]:
        return self._dense.extras()

    def close(self) -> None:
        for reader in getattr(self, "_readers", []):
            reader.close()


def _claims_moe(probe: Probe) -> bool:
    files = probe.deepspeed
    return files is not None and bool(files.experts) and not (files.layers or files.stage0) and not probe.autoep


def _open_moe(probe: Probe, how: How) -> Reader:
    assert probe.deepspeed is not None  # claimed
    return MoeSource(probe.deepspeed, optimizer=how.optimizer)


FORMAT = SourceFormat(
    name="deepspeed-moe",
    label="DeepSpeed mixture-of-experts checkpoint (deepspeed.moe)",
    docs="format.md#expert-parallelism-legacy-deepspeedmoelayermoe",
    claims=_claims_moe,
    open=_open_moe,
    family="deepspeed",
)
