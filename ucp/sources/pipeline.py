"""A pipeline-parallel DeepSpeed checkpoint (``deepspeed.pipe.PipelineModule``, PP x DP or PP x TP x DP,
ZeRO-0/1 or BF16_Optimizer) -> one reader of the whole model.

Each stage's model-states and optim files form an ordinary ZeRO-1/2 checkpoint of that stage's
parameters (:mod:`ucp.deepspeed.pipeline` has the layout), read by one
:class:`~ucp.sources.zero12.Zero12Source` per stage, or under tensor parallelism by one
:class:`~ucp.sources.tensor_parallel.TensorParallelSource` over the stage's TP ranks (merged by the
checkpoint's ``universal_checkpoint_info`` or given rules, as for any TP checkpoint); the stage's
model-states file holds no module, so frozen parameters and buffers come from the layer files, read
here (a frozen parameter merged by its rule, a buffer equal on every TP rank). Names are the PipelineModule's
own (``tied_modules.embed.weight``, ``3.fc1.weight``): what ``engine.module.state_dict()`` holds on
each stage, and what a PipelineModule at any other PP size names the same weights. A tied module is
an optimized parameter of every stage that uses it; it is kept once, with the first such stage's state
(the others' copies are checked to be the same bytes when read).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed.fields import build_facts, need_mapping, need_tensor
from ucp.deepspeed.layout import CheckpointFiles
from ucp.deepspeed.model_states import module_buffers, zero12_frozen_values
from ucp.deepspeed.optim_states import optimizer_block
from ucp.deepspeed.pipeline import TIED_PREFIX, layer_prefix, pipeline_degrees
from ucp.errors import InputError
from ucp.io.torchfile import TorchFile
from ucp.model import tp as tpl
from ucp.model.layouts import SourceLayout
from ucp.model.pieces import Pieces
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, PieceState, Reader, dtype_name
from ucp.sources.format import How, Probe, SourceFormat
from ucp.sources.tensor_parallel import (
    INFO_KEY,
    TensorParallelSource,
    checkpoint_tp_info,
    merge_shards,
    rank_layouts_of,
    rules_for,
)
from ucp.sources.zero12 import Zero12Source

__all__ = ["FORMAT", "PipelineSource"]

logger = logging.getLogger(__name__)


def _same_state(a: ParamState, b: ParamState) -> bool:
    return (
        torch.equal(a.fp32, b.fp32)
        and a.optim.keys() == b.optim.keys()
        and all(torch.equal(a.optim[k], b.optim[k]) for k in a.optim)
        and a.step == b.step
    )


class PipelineSource(Reader):
    """A pipeline-parallel ZeRO-0/1 checkpoint as a :class:`~ucp.model.records.Reader`.

    Call order: construct (opens every stage's files and the layer files, merges the stages' facts);
    ``read``/``read_pieces`` per parameter from any thread (each goes to the stage that holds it);
    ``buffers``/``extras``; ``close``. ``pipeline`` describes the stages for ``ucp inspect``.
    """

    streams = True

    def __init__(
        self, files: CheckpointFiles, *, optimizer: str | None = None, rules: Sequence[tuple[str, tpl.TpRule]] = ()
    ) -> None:
        self.files = files
        self.tp = 1
        self._rules = rules
        self._stages: list[Reader] = []
        self._layers: list[TorchFile] = []
        self.facts = build_facts(
            lambda: self._build(optimizer),
            close=self.close,
            where=f"{files.tag_dir}: the files are not a pipeline-parallel checkpoint ucp can read",
        )

    # -- facts -------------------------------------------------------------------------------
    def _degrees(self) -> tuple[int, int]:
        """(pp, tp) from the first model-states file, checked against the layer files' TP ranks."""
        first = self.files.model[0][0]
        with TorchFile(first) as tf:
            head = need_mapping(tf.obj, first.name)
            pp, tp = pipeline_degrees(head, self.files.mp, first.name)
        found = sorted({t for _, t, _ in self.files.layers if t is not None})
        if found and found != list(range(tp)):
            raise InputError(
                f"{self.files.tag_dir}: the layer files are for tensor-parallel ranks {found}, but {first.name} "
                f"says tp_degree={tp}: files of different runs are mixed"
            )
        return pp, tp

    def _stage_reader(self, stage: int, optimizer: str | None) -> Reader:
        """One stage's parameters: its ZeRO-1/2 files, merged over its TP ranks (mp ranks ``stage*tp+t``)."""

        def rank(mp_rank: int) -> Reader:
            # the stage's model-states file says module=None; an empty module leaves frozen weights and
            # buffers to the layer files, read below (and, for a bf16 save without ZeRO, the shapes)
            return Zero12Source(
                self.files,
                optimizer=optimizer,
                mp_rank=mp_rank,
                module={},
                shapes_of=lambda names: self._layer_shapes(mp_rank % self.tp, set(names) | self._mapped_names()),
            )

        if self.tp == 1:
            return rank(stage)
        ranks = range(stage * self.tp, (stage + 1) * self.tp)
        return TensorParallelSource(
            self.files, optimizer=optimizer, rules=self._rules, mp_ranks=ranks, rank_reader=rank
        )

    def _build(self, optimizer: str | None) -> Facts:
        pp, self.tp = self._degrees()
        self.streams = self.tp == 1  # TP shards are merged in memory
        for stage in range(pp):
            self._stages.append(self._stage_reader(stage, optimizer))
        first = self._stages[0].facts
        for stage, reader in enumerate(self._stages[1:], 1):
            self._check_stage(stage, reader.facts, first)
        groups, params, warnings = self._merge_groups()
        buffer_names = [n for reader in self._stages for n in reader.facts.buffer_names]
        self._module = self._layer_module({p.name for p in params} | set(buffer_names), set(buffer_names))
        head = {"module": self._module, "buffer_names": buffer_names}
        optimized = [p.name for p in params]
        self._frozen = zero12_frozen_values(head, optimized, {}, buffer_names, self.files.tag_dir.name)
        params += [ParamMeta(n, tuple(v.shape), dtype_name(v.dtype), None, True) for n, v in self._frozen.items()]
        steps = [g.step for g in groups if g.step is not None]
        rules = {n: r for reader in self._stages for n, r in reader.facts.tp_rules.items()}
        rules.update({n: r.to_json() for n, r in self._frozen_rules.items() if n in self._frozen})
        return replace(
            first,
            info=replace(first.info, mp_world_size=1),
            step=max(steps, default=None),
            groups=groups,
            params=params,
            tied={},
            tp_rules=rules,
            buffer_names=buffer_names,
            warnings=list(dict.fromkeys(w for r in self._stages for w in r.facts.warnings)) + warnings,
            layout=SourceLayout("pipeline", self._describe(buffer_names)),
        )

    def _model_file(self, stage: int) -> str:
        return self.files.model[stage * self.tp][0].name

    def _check_stage(self, stage: int, facts: Facts, first: Facts) -> None:
        """Stages of one run share the DP size, optimizer, param groups' settings and counters."""
        name = self._model_file(stage)
        if facts.info.dp_world_size != first.info.dp_world_size:
            raise InputError(
                f"{name}: stage {stage} has {facts.info.dp_world_size} optim rank files, stage 0 "
                f"{first.info.dp_world_size}: files of different runs are mixed"
            )
        if (facts.flavour, facts.info.zero_stage, facts.info.global_steps) != (
            first.flavour,
            first.info.zero_stage,
            first.info.global_steps,
        ):
            raise InputError(
                f"{name}: stage {stage} disagrees with stage 0 on the optimizer, ZeRO stage or global_steps: "
                "files of different runs are mixed"
            )
        if len(facts.groups) != len(first.groups):
            raise InputError(
                f"{name}: stage {stage} has {len(facts.groups)} param groups, stage 0 {len(first.groups)}: ucp "
                "merges stages whose optimizers were built with the same groups"
            )
        for mine, theirs in zip(facts.groups, first.groups):
            if mine.raw != theirs.raw:
                raise InputError(
                    f"{name}: param group {mine.index} of stage {stage} has other settings than on stage 0 "
                    f"({mine.raw} vs {theirs.raw}); ucp keeps one set per group"
                )

    def _merge_groups(self) -> tuple[list[GroupMeta], list[ParamMeta], list[str]]:
        """Each group's members, stage after stage in flat order; a tied module once, at its first stage."""
        self._owner: dict[str, int] = {}
        self._copies: dict[str, list[int]] = {}
        groups: list[GroupMeta] = []
        params: list[ParamMeta] = []
        warnings: list[str] = []
        for g, head in enumerate(self._stages[0].facts.groups):
            names: list[str] = []
            metas = [reader.facts.groups[g] for reader in self._stages]
            for stage, meta in enumerate(metas):
                for pname in meta.params:
                    if pname not in self._owner:
                        self._owner[pname] = stage
                        names.append(pname)
                        params.append(self._stages[stage].facts.param(pname))
                        continue
                    owner = self._owner[pname]
                    if not pname.startswith(TIED_PREFIX) or pname not in metas[owner].params:
                        raise InputError(
                            f"{self.files.tag_dir}: parameter {pname!r} is optimized on stages {owner} and {stage} "
                            "(in other param groups, or not a TiedLayerSpec module): files of different runs?"
                        )
                    self._copies.setdefault(pname, []).append(stage)
            steps = {meta.step for meta in metas}
            if len(steps) > 1:
                warnings.append(f"param group {g} has different steps across stages: {sorted(map(str, steps))}")
            keys = {meta.state_keys for meta in metas if meta.state_keys}
            if len(keys) > 1:
                raise InputError(
                    f"{self.files.tag_dir}: param group {g} keeps other optimizer state on different stages "
                    f"({sorted(keys)}): files of different runs are mixed"
                )
            step = max((s for s in steps if s is not None), default=None)
            groups.append(replace(head, params=names, step=step, state_keys=keys.pop() if keys else ()))
        return groups, params, warnings

    def _mapped_names(self) -> set[str]:
        """Every parameter name the optim files of all stages map (``param_slice_mappings``): a layer file's
        names are told apart by them (a stage's own names alone would take another stage's LayerNorm
        ``weight`` for the tied embedding's)."""
        if not hasattr(self, "_mapped"):
            self._mapped: set[str] = set()
            for paths in self.files.optim:
                for path in paths:
                    with TorchFile(path) as tf:
                        for mapping in optimizer_block(tf).get("param_slice_mappings") or []:
                            self._mapped.update(str(n) for n in need_mapping(mapping, f"{path.name}: a slice mapping"))
        return self._mapped

    def _layer_shapes(self, tp_rank: int, known: set[str]) -> dict[str, tuple[int, ...]]:
        """Every layer tensor's shape in TP rank ``tp_rank``'s layer files, under the PipelineModule's names
        (``known``: the names the optim files give): what a bf16 save without ZeRO (BF16_Optimizer, no
        ``param_shapes``) says of its parameters' shapes nowhere else."""
        shapes: dict[str, tuple[int, ...]] = {}
        for layer, rank, path in self.files.layers:
            if rank not in (None, tp_rank):
                continue
            with TorchFile(path) as tf:
                obj = need_mapping(tf.obj, path.name)
                prefix = layer_prefix(layer, map(str, obj), known)
                for key, value in obj.items():
                    shapes[prefix + str(key)] = tuple(need_tensor(value, f"{path.name}: {key}", floating=False).shape)
        return shapes

    def _layer_module(self, known: set[str], buffers: set[str]) -> dict[str, torch.Tensor]:
        """Every layer file's tensors under the PipelineModule's names. A tied module written by several
        stages (one used without a ``forward_fn``) appears once, from its first layer. Under tensor
        parallelism each layer has a file per TP rank, merged by :meth:`_merge_layer`."""
        module: dict[str, torch.Tensor] = {}
        self._layer_names: dict[int, list[str]] = {}
        self._frozen_rules: dict[str, tpl.TpRule] = {}
        by_layer: dict[int, list[Path]] = {}
        for layer, _, path in self.files.layers:  # sorted by layer, then TP rank
            by_layer.setdefault(layer, []).append(path)
        for layer, paths in by_layer.items():
            ranks = []
            for path in paths:
                tf = TorchFile(path)
                self._layers.append(tf)
                obj = need_mapping(tf.obj, path.name)
                ranks.append({str(k): need_tensor(v, f"{path.name}: {k}", floating=False) for k, v in obj.items()})
            prefix = layer_prefix(layer, ranks[0], known)
            self._layer_names[layer] = [prefix + k for k in ranks[0]]
            for key in ranks[0]:
                name = prefix + key
                if name not in module:
                    module[name] = self._merge_layer(name, [r.get(key) for r in ranks], paths, known, buffers)
        return module

    def _merge_layer(
        self, name: str, copies: list[torch.Tensor | None], paths: list[Path], known: set[str], buffers: set[str]
    ) -> torch.Tensor:
        """One layer tensor from its TP ranks' files: an optimized parameter's (its masters are the
        optimizer's; rank 0's copy only marks it), a buffer equal on every rank, a frozen parameter merged
        by its rule (the checkpoint's ``universal_checkpoint_info`` or given rules)."""
        if any(c is None for c in copies):
            missing = paths[copies.index(None)].name
            raise InputError(f"{missing} lacks {name!r}, which TP rank 0's layer file holds: files of different runs?")
        tensors: list[torch.Tensor] = [c for c in copies if c is not None]
        if len(tensors) == 1 or (name in known and name not in buffers):
            return tensors[0]
        if name in buffers:
            if any(not torch.equal(tensors[0], t) for t in tensors[1:]):
                raise InputError(
                    f"{self.files.tag_dir}: buffer {name!r} differs between TP ranks; ucp cannot tell how a buffer "
                    "is split"
                )
            return tensors[0]
        shapes = [tuple(t.shape) for t in tensors]
        info = self._info()
        rules = rules_for(info, {name: shapes}, self._rules, str(self.files.tag_dir))
        if name not in rules:
            raise InputError(
                f"{self.files.tag_dir}: frozen parameter {name!r} is saved by {len(tensors)} TP ranks but no rule "
                f"says how to merge it: the checkpoint carries no {INFO_KEY}; give the rules in the migration "
                "YAML (tensor_parallel.rules)"
            )
        rule = self._frozen_rules[name] = rules[name]
        full, layouts = rank_layouts_of(info, name, rule, shapes, f"{self.files.tag_dir}: {name}")
        return merge_shards(tensors, layouts, full, f"{self.files.tag_dir}: {name}")

    def _info(self) -> dict[str, Any]:
        if not hasattr(self, "_tp_info"):
            self._tp_info = checkpoint_tp_info(self.files)
        return self._tp_info

    def _describe(self, buffer_names: list[str]) -> dict[str, Any]:
        """The stages as ``ucp inspect`` shows them: files, layers, parameters, tied modules."""
        stages = []
        for stage, reader in enumerate(self._stages):
            names = {n for g in reader.facts.groups for n in g.params} | set(reader.facts.buffer_names)
            layers = sorted(layer for layer, held in self._layer_names.items() if names & set(held))
            stages.append(
                {
                    "stage": stage,
                    "model_file": self._model_file(stage),
                    "optim_files": sum(len(self.files.optim[stage * self.tp + t]) for t in range(self.tp)),
                    "layers": layers,
                    "layer_files": [path.name for layer, _, path in self.files.layers if layer in layers],
                    "params": sorted(names - set(buffer_names)),
                    "numel": sum(reader.facts.param(n).numel for n in names - set(buffer_names)),
                }
            )
        tied = {n: [self._owner[n], *stages_] for n, stages_ in self._copies.items()}
        return {"pp": len(self._stages), "tp": self.tp, "stages": stages, "tied_across_stages": tied}

    # -- tensors -----------------------------------------------------------------------------
    def _check_copies(self, name: str, moments: bool) -> None:
        """A tied module's copies on later stages must be the first stage's bytes (DeepSpeed all-reduces
        their gradients, so they step alike); if not, the first stage's is kept and a warning says so."""
        owner = self._stages[self._owner[name]].read(name, moments=moments)
        for stage in self._copies[name]:
            if not _same_state(owner, self._stages[stage].read(name, moments=moments)):
                logger.warning(
                    "%s: tied across stages, but stage %d's copy differs from stage %d's; keeping stage %d's",
                    name,
                    stage,
                    self._owner[name],
                    self._owner[name],
                )

    @contextmanager
    def read_pieces(self, name: str, *, moments: bool = True) -> Iterator[PieceState]:
        if name in self._frozen:
            yield PieceState(fp32=Pieces.of(self._frozen[name].detach().to(torch.float32, copy=True)))
            return
        if name not in self._owner:
            raise InputError(f"parameter {name!r} is not in this checkpoint")
        if name in self._copies:
            self._check_copies(name, moments)
        with self._stages[self._owner[name]].read_pieces(name, moments=moments) as state:
            yield state

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        with self.read_pieces(name, moments=moments) as state:
            return state.joined()

    def buffers(self) -> dict[str, torch.Tensor]:
        head: Mapping[str, Any] = {"module": self._module, "buffer_names": self.facts.buffer_names}
        return module_buffers(head, self.files.tag_dir.name)

    def extras(self) -> dict[str, Any]:
        return self._stages[0].extras()  # the scheduler, counters and loss scaler are the same on every stage

    def close(self) -> None:
        for reader in getattr(self, "_stages", []):
            reader.close()
        for tf in getattr(self, "_layers", []):
            tf.close()


def _claims_pipeline(probe: Probe) -> bool:
    files = probe.deepspeed
    return files is not None and bool(files.layers) and not files.stage0


def _open_pipeline(probe: Probe, how: How) -> Reader:
    assert probe.deepspeed is not None  # claimed
    return PipelineSource(probe.deepspeed, optimizer=how.optimizer, rules=how.tp_rules)


FORMAT = SourceFormat(
    name="deepspeed-pipeline",
    label="DeepSpeed pipeline-parallel checkpoint (PipelineEngine)",
    docs="format.md#pipeline-parallelism-deepspeedpipepipelinemodule-pipelineengine",
    claims=_claims_pipeline,
    open=_open_pipeline,
    family="deepspeed",
)
