"""DeepSpeed ZeRO-1/2 checkpoints -> per-parameter state, streamed one parameter at a time.

Two wrappers write these files: ``DeepSpeedZeroOptimizer`` (stage 1 and 2, fp32/bf16/fp16) and
``BF16_Optimizer`` (bf16 with ``data_types.grad_accum_dtype=fp32``). Both keep, per param group,
one flat buffer cut into ``dp`` equal partitions (``ucp.model.partition.zero12_group``): each rank's
file holds its partition of the fp32 masters (``single_partition_of_fp32_groups``; DeepSpeedZeroOptimizer
strips the end padding, BF16_Optimizer keeps it) and of the Adam moments (torch state of the flat
partition, always padded). The one model-states file names the members of each group in flat
order (``param_shapes``) and holds the low-precision module, frozen parameters included.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ucp.deepspeed.fields import (
    as_int,
    build_facts,
    check_one_version,
    jsonable,
    need_list,
    need_mapping,
    need_tensor,
    tensor_shape,
)
from ucp.deepspeed.layout import CheckpointFiles, optim_file
from ucp.deepspeed.model_states import (
    EXCLUDED_FROZEN_NOTE,
    check_model_states,
    engine_counters,
    frozen_excluded,
    model_dtype,
    model_extras,
    module_buffers,
    module_ties,
    module_weight,
    zero12_frozen_values,
)
from ucp.deepspeed.optim_states import (
    check_rank_count,
    check_slice_mappings,
    flat_state_keys,
    optimizer_block,
    rank_scalars,
    zero12_layouts,
)
from ucp.errors import InputError
from ucp.io.torchfile import TorchFile
from ucp.model.detect import Detection, detect, offloads_optimizer, round_robin_gradients, unsaved_state_note
from ucp.model.options import zero_label
from ucp.model.partition import Zero12Group, round_robin_order, zero12_group
from ucp.model.pieces import Pieces
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, PieceState, Reader, SourceInfo, dtype_name
from ucp.model.zenflow import ZENFLOW_NOTE, ZENFLOW_OVERLAP_NOTE, newest_master, zenflow_config
from ucp.sources.common import file_pieces, group_meta
from ucp.sources.format import How, Probe, SourceFormat

__all__ = ["FORMAT", "Zero12Source"]

logger = logging.getLogger(__name__)

_FP32 = "single_partition_of_fp32_groups"
_BASE = "base_optimizer_state"


class Zero12Source(Reader):
    """A ZeRO-1/2 checkpoint as a :class:`~ucp.model.records.Reader` (one mp rank).

    Call order: construct (reads and checks every file's small object tree; tensors stay on the
    mmap), then ``read`` per parameter from any thread, ``buffers``/``extras``, ``close``.
    """

    streams = True

    def __init__(
        self,
        files: CheckpointFiles,
        *,
        optimizer: str | None = None,
        mp_rank: int = 0,
        module: Mapping[str, Any] | None = None,
        groups: Collection[int] | None = None,
        rename: Mapping[str, str] | None = None,
        head: Mapping[str, Any] | None = None,
        shapes_of: Callable[[Collection[str]], Mapping[str, tuple[int, ...]]] | None = None,
    ) -> None:
        self.files = files
        self.mp_rank = mp_rank
        # model-states fields read instead of the file's: a pipeline stage's file holds module=None (its
        # weights are in layer files), so its reader is handed the module; a MoE expert reader's ranks are
        # its expert-data-parallel group, not dp_world_size
        self._fields = {**({} if module is None else {"module": module}), **(head or {})}
        # a MoE checkpoint partitions its expert groups over other ranks than its dense ones: each of
        # its readers reads some groups (the others keep no members) and gives the experts their
        # global names (``rename``: param_shapes name -> name read)
        self._only = None if groups is None else frozenset(groups)
        self._rename = dict(rename or {})
        # a stage-0 BF16_Optimizer save (a bf16 pipeline's) writes no param_shapes: the ranks' param_slice_mappings
        # name the members in flat order, and ``shapes_of(names)`` gives their shapes (a pipeline's layer files)
        self._shapes_of = shapes_of
        self._optim: list[TorchFile] = []
        self._model: TorchFile | None = None

        def build() -> Facts:
            for path in files.optim[mp_rank]:
                self._optim.append(TorchFile(path))
            self._model = TorchFile(files.model[mp_rank][0])
            return self._facts(optimizer)

        self.facts = build_facts(
            build, close=self.close, where=f"{files.tag_dir}: the rank files are not a ZeRO-1/2 checkpoint ucp can read"
        )

    # -- facts -------------------------------------------------------------------------------
    def _rank_file(self, dp_rank: int) -> str:
        return optim_file(dp_rank, self.mp_rank, bf16=self.files.bf16_prefix)

    def _stage(self, blocks: list[Mapping[str, Any]], head: Mapping[str, Any]) -> tuple[int, str]:
        """The ZeRO stage and which wrapper wrote the files: 'zero' (DeepSpeedZeroOptimizer) or 'bf16'."""
        kinds = set()
        stages = set()
        for tf, block in zip(self._optim, blocks):
            for key in (_BASE, _FP32):
                if key not in block:
                    raise InputError(f"{tf.path.name} has no {key}: not a ZeRO-1/2 optim-states file")
            if block.get("zero_stage") is None:
                kinds.add("bf16")  # BF16_Optimizer writes no zero_stage
                continue
            kinds.add("zero")
            stage = as_int(block["zero_stage"], f"{tf.path.name}: zero_stage")
            if stage == 3:
                raise InputError(
                    f"{tf.path.name} says zero_stage=3, but its folder holds a ZeRO-1/2 model file "
                    f"({self._model_name()}) and no per-rank model states; the checkpoint mixes stages"
                )
            if stage not in (1, 2):
                raise InputError(
                    f"{tf.path.name}: zero_stage={stage} is not supported: ucp reads ZeRO stage 1, 2 and 3 checkpoints"
                )
            stages.add(stage)
        if len(kinds) > 1:
            raise InputError(
                f"{self.files.tag_dir} mixes files of DeepSpeedZeroOptimizer and BF16_Optimizer: ranks "
                "from different runs are mixed"
            )
        if len(stages) > 1:
            raise InputError(
                f"rank files disagree on zero_stage ({sorted(stages)}): ranks from different runs are mixed"
            )
        kind = kinds.pop()
        if kind == "zero":
            return stages.pop(), kind
        zero = (head.get("ds_config") or {}).get("zero_optimization") or {}
        stage = as_int(zero.get("stage", 0), "ds_config zero_optimization.stage") if isinstance(zero, Mapping) else 0
        if stage not in (0, 1):
            raise InputError(
                f"{self._model_name()}: ds_config says zero stage {stage}, but the optim files were "
                "written by BF16_Optimizer (stage 0 or 1)"
            )
        self._stage0 = stage == 0
        return 1, kind

    def _mapped_shapes(
        self, blocks: list[Mapping[str, Any]], shapes_of: Callable[[Collection[str]], Mapping[str, tuple[int, ...]]]
    ) -> list[OrderedDict[str, torch.Size]]:
        """param_shapes rebuilt: each group's members in flat order (rank by rank, by slice start, as the ranks'
        ``param_slice_mappings`` place them; checked against the layout later) and their shapes from ``shapes_of``."""
        placed: list[dict[str, tuple[int, int]]] = []
        for rank, (tf, block) in enumerate(zip(self._optim, blocks)):
            mappings = block.get("param_slice_mappings")
            if mappings is None:
                raise InputError(
                    f"{tf.path.name}: neither it nor {self._model_name()} names the parameters (no param_slice_mappings, "
                    "no param_shapes): not converted"
                )
            for g, mapping in enumerate(need_list(mappings, f"{tf.path.name}: param_slice_mappings")):
                placed += [{} for _ in range(g + 1 - len(placed))]
                for pname, address in need_mapping(mapping, f"{tf.path.name}: param_slice_mappings[{g}]").items():
                    start = as_int(getattr(address, "start", None), f"{tf.path.name}: slice start of {pname!r}")
                    placed[g].setdefault(str(pname), (rank, start))
        order = [sorted(group, key=group.__getitem__) for group in placed]
        shapes = shapes_of([n for names in order for n in names])
        for names in order:
            for pname in names:
                if pname not in shapes:
                    raise InputError(
                        f"{self._model_name()}: a stage-0 BF16_Optimizer save records no param_shapes, and no layer file "
                        f"holds {pname!r} (a TiedLayerSpec given a forward_fn gets none): its shape is unknown; not converted"
                    )
        return [OrderedDict((n, torch.Size(shapes[n])) for n in names) for names in order]

    def _reads(self, group: int) -> bool:
        return self._only is None or group in self._only

    def _head(self) -> Mapping[str, Any]:
        """The model-states file's object, with the fields handed in instead of its own."""
        assert self._model is not None
        obj = self._model.obj
        if not self._fields or not isinstance(obj, Mapping):
            return obj
        return {**obj, **self._fields}

    def _model_name(self) -> str:
        return self._model.path.name if self._model is not None else "model states"

    def _check_rank_count(self, blocks: list[Mapping[str, Any]], head: Mapping[str, Any]) -> None:
        dp = len(self._optim)
        for tf, block in zip(self._optim, blocks):
            check_rank_count(
                block, tf.path.name, [t.path.name for t in self._optim], self._rank_file, self.files.tag_dir, self._only
            )
        world = head.get("dp_world_size")
        if world is not None and as_int(world, "dp_world_size") != dp:
            raise InputError(
                f"{self._model_name()} says dp_world_size={as_int(world, 'dp_world_size')}, but {dp} "
                "optim rank files were found: files from different runs are mixed"
            )

    def _check_model(self) -> Mapping[str, Any]:
        assert self._model is not None
        name = self._model.path.name
        head = self._head()
        check_model_states(head, name, "not a ZeRO-1/2 model-states file (saved without optimizer state?)")
        stamped = [head] + [tf.obj for tf in self._optim if isinstance(tf.obj, Mapping)]
        stamped += [optimizer_block(tf) for tf in self._optim]
        check_one_version(stamped)
        return head

    def _base(self, tf: TorchFile, block: Mapping[str, Any]) -> tuple[list[Mapping[str, Any]], Mapping[Any, Any]]:
        """The torch optimizer state of the flat partitions: its param groups and per-group state."""
        name = tf.path.name
        base = block[_BASE]
        if isinstance(base, (list, tuple)):
            raise InputError(
                f"{name} was saved with zero_optimization.elastic_checkpoint=true, which keeps no param "
                "groups; ucp reads the default (rigid) ZeRO-1/2 checkpoints"
            )
        base = need_mapping(base, f"{name}: {_BASE}")
        groups = [
            need_mapping(g, f"{name}: a param group")
            for g in need_list(base.get("param_groups") or [], f"{name}: param_groups")
        ]
        for g, group in enumerate(groups):
            members = [
                as_int(p, f"{name}: param group {g} params entry")
                for p in need_list(group.get("params", []), f"{name}: param group {g} params")
            ]
            if members != [g]:
                raise InputError(
                    f"{name}: param group {g} holds flat tensors {members}, expected [{g}]: not a "
                    "ZeRO-1/2 optimizer (one flat partition per group)"
                )
        state = need_mapping(base.get("state") or {}, f"{name}: optimizer state")
        return groups, state

    def _layouts(self, shapes: list[Mapping[str, Any]], blocks: list[Mapping[str, Any]]) -> list[Zero12Group]:
        paddings = blocks[0].get("param_alignment_paddings")
        return zero12_layouts(shapes, paddings, len(self._optim), self._optim[0].path.name)

    def _check_group_sizes(
        self,
        shapes: list[Mapping[str, Any]],
        blocks: list[Mapping[str, Any]],
        layouts: list[Zero12Group],
        states: list[Mapping[Any, Any]],
    ) -> None:
        """Every rank's buffers must be exactly the sizes the parameters imply at this DP size."""
        dp = len(self._optim)
        self._keys: list[tuple[str, ...]] = [() for _ in layouts]
        self._scalars: list[dict[str, torch.Tensor]] = [{} for _ in layouts]
        for rank, (tf, block, state) in enumerate(zip(self._optim, blocks, states)):
            name = tf.path.name
            fp32 = need_list(block[_FP32], f"{name}: {_FP32}")
            group_paddings = need_list(block.get("group_paddings") or [], f"{name}: group_paddings")
            if len(fp32) != len(shapes) or len(group_paddings) != len(shapes):
                raise InputError(
                    f"{name} holds {len(fp32)} fp32 partitions and {len(group_paddings)} group paddings, "
                    f"but param_shapes has {len(shapes)} param groups"
                )
            mappings = block.get("param_slice_mappings")
            for g, layout in enumerate(layouts):
                if not self._reads(g):
                    continue
                size, pad = layout.partition_size, layout.padding(rank)
                have_pad = as_int(group_paddings[g], f"{name}: group_paddings[{g}]")
                tensor = need_tensor(fp32[g], f"{name}: {_FP32}[{g}]")
                if tensor.dim() != 1 or tensor.numel() not in (size - pad, size) or have_pad != pad:
                    raise InputError(
                        f"param group {g} on rank {rank} holds {tensor.numel()} fp32 elements with padding {have_pad}, "
                        f"but its parameters ({layout.numel} elements) split at dp={dp} give partitions of {size} "
                        f"with padding {pad}: the group sizes do not add up (param_shapes do not match the shards)"
                    )
                if state:
                    entry = need_mapping(state.get(g), f"{name}: optimizer state of param group {g}")
                    whole = {key: layout.whole_size(rank) for key in self._whole[g]}
                    self._keys[g] = flat_state_keys(
                        entry, size, f"{name}: param group {g}", self._keys[g] if rank else None, whole
                    )
                    where = f"{name}: param group {g}"
                    self._scalars[g] = rank_scalars(entry, self._scalars[g] if rank else None, where, self._derived)
                if mappings is not None:
                    mapping = need_list(mappings, f"{name}: param_slice_mappings")[g]
                    where = f"{name}: param group {g}"
                    check_slice_mappings(mapping, list(shapes[g]), layout, rank, where, self._original_layout(g))

    def _original_order(self, g: int) -> list[int]:
        """Param group g's members in their original order, as indices into param_shapes (flat order): a
        ``round_robin_gradients`` run flattens them in round-robin order over its ranks."""
        count = len(self._flat_names[g])
        if not self._round_robin:
            return list(range(count))
        flat_of = [0] * count
        for k, original in enumerate(round_robin_order(count, len(self._optim))):
            flat_of[original] = k
        return flat_of

    def _original_layout(self, g: int) -> tuple[list[str], Zero12Group] | None:
        """A round-robin group's members in their original order and the layout DeepSpeed's fragment
        mappings assume for them (``check_slice_mappings``); None for other runs."""
        if not self._round_robin:
            return None
        flat = self._layouts_[g]
        order = self._original_order(g)
        names = [self._flat_names[g][i] for i in order]
        return names, zero12_group([flat.numels[i] for i in order], flat.dp)

    def _check_moments(self, bases: list[tuple[list[Mapping[str, Any]], Mapping[Any, Any]]]) -> None:
        """Every rank holds optimizer state, or none does."""
        head_state = bases[0][1]
        self._has_moments = bool(head_state)
        for tf, (_, rank_state) in zip(self._optim, bases):
            if bool(rank_state) != self._has_moments:
                raise InputError(
                    f"{tf.path.name} {'has' if rank_state else 'lacks'} optimizer moments but "
                    f"{self._optim[0].path.name} {'has' if head_state else 'lacks'} them: ranks from different "
                    "saves are mixed"
                )

    def _group_steps(
        self,
        groups_raw: list[Mapping[str, Any]],
        bases: list[tuple[list[Mapping[str, Any]], Mapping[Any, Any]]],
        detection: Detection,
    ) -> list[int | None]:
        """Each param group's step, checked across ranks (the highest wins, with a warning)."""
        group_steps: list[int | None] = []
        for g, group in enumerate(groups_raw):
            seen: set[int | None] = set()
            for _, rank_state in bases:
                entry = rank_state.get(g, {})
                seen.add(detection.flavour.read_step(group, entry) if detection.flavour else None)
            if len(seen) > 1:
                detection.warnings.append(f"param group {g} has different steps across ranks: {sorted(map(str, seen))}")
            group_steps.append(max((s for s in seen if s is not None), default=None))
        return group_steps

    def _groups(
        self,
        groups_raw: list[Mapping[str, Any]],
        shapes: list[Mapping[str, Any]],
        group_steps: list[int | None],
        detection: Detection,
        dtype: str,
    ) -> tuple[list[ParamMeta], list[GroupMeta]]:
        """The optimized parameters in group order (placing each), and each group's metadata."""
        self._where: dict[str, tuple[int, int]] = {}  # name -> (group, index in group)
        self._shape: dict[str, tuple[int, ...]] = {}
        params: list[ParamMeta] = []
        groups: list[GroupMeta] = []
        for g, group in enumerate(groups_raw):
            names = []
            members = list(shapes[g].items()) if self._reads(g) else []
            for i in self._original_order(g) if members else ():
                local, shape = members[i]
                pname = self._rename.get(local, local)
                if pname in self._where:
                    raise InputError(f"parameter {pname!r} appears twice in param_shapes")
                self._where[pname] = (g, i)
                self._shape[pname] = tensor_shape(shape)
                names.append(pname)
                params.append(ParamMeta(pname, self._shape[pname], dtype, g, False))
            groups.append(group_meta(g, group, names, group_steps[g], detection.adam_w_mode, self._keys[g]))
        return params, groups

    def _facts(self, optimizer: str | None) -> Facts:
        dp = len(self._optim)
        blocks = [optimizer_block(tf) for tf in self._optim]
        if (
            self._shapes_of is not None
            and isinstance(self._head(), Mapping)
            and self._head().get("param_shapes") is None
        ):
            self._fields["param_shapes"] = self._mapped_shapes(blocks, self._shapes_of)
        head = self._check_model()
        stage, self._kind = self._stage(blocks, head)
        self._check_rank_count(blocks, head)
        shapes = [need_mapping(g, "param_shapes entry") for g in head["param_shapes"]]
        ds_config = head.get("ds_config") or {}
        bases = [self._base(tf, block) for tf, block in zip(self._optim, blocks)]
        groups_raw = bases[0][0]
        if len(groups_raw) != len(shapes):
            raise InputError(
                f"{self._optim[0].path.name} has {len(groups_raw)} param groups, but param_shapes has {len(shapes)}"
            )
        for tf, (rank_groups, _) in zip(self._optim[1:], bases[1:]):
            if len(rank_groups) != len(groups_raw):
                raise InputError(
                    f"{tf.path.name} and {self._optim[0].path.name} have different numbers of param "
                    "groups: ranks from different runs are mixed"
                )
        for pad_list in (b.get("param_alignment_paddings") for b in blocks[1:]):
            if pad_list != blocks[0].get("param_alignment_paddings"):
                raise InputError("rank files disagree on param_alignment_paddings: ranks from different runs are mixed")
        self._check_moments(bases)
        self._layouts_ = self._layouts(shapes, blocks)
        self._flat_names = [list(g) for g in shapes]
        self._round_robin = self._kind == "zero" and dp > 1 and round_robin_gradients(ds_config)
        detection = detect(blocks[0][_BASE], ds_config, optimizer or self.files.reset_flavour)
        offload = offloads_optimizer(ds_config)
        flavour = detection.flavour
        self._whole = [flavour.zero12_whole_keys(g, offload=offload) if flavour else () for g in groups_raw]
        self._derived = flavour.derived if flavour else ()
        self._check_group_sizes(shapes, blocks, self._layouts_, [s for _, s in bases])
        group_steps = self._group_steps(groups_raw, bases, detection)
        dtype = model_dtype(head, shapes, files_bf16=self.files.bf16_prefix)
        params, groups = self._groups(groups_raw, shapes, group_steps, detection, dtype)
        tied = module_ties(head, self._where)
        buffer_names = list(head.get("buffer_names") or [])
        self._frozen: dict[str, torch.Tensor] = {}
        for pname, value in zero12_frozen_values(head, self._where, tied, buffer_names, self._model_name()).items():
            if pname in self._where:
                raise InputError(f"parameter {pname!r} is listed both as optimized and as frozen")
            self._frozen[pname] = value
            params.append(ParamMeta(pname, tuple(value.shape), dtype_name(value.dtype), None, True))
        excluded = frozen_excluded(head, stage)
        warnings = list(detection.warnings) + ([EXCLUDED_FROZEN_NOTE] if excluded else [])
        zenflow = zenflow_config(ds_config)
        self._zenflow = zenflow is not None
        if zenflow is not None:
            warnings += [ZENFLOW_NOTE] + ([ZENFLOW_OVERLAP_NOTE] if zenflow.get("overlap_step") is True else [])
        if getattr(self, "_stage0", False):
            warnings.append(
                "written by BF16_Optimizer without ZeRO (stage 0); its optimizer state is partitioned "
                "like ZeRO-1, so ucp reads it as stage 1"
            )
        counters = engine_counters(head)
        unsaved = (
            None
            if self._has_moments
            else unsaved_state_note(
                ds_config, counters["global_steps"] - counters["skipped_steps"], self.files.reset_flavour
            )
        )
        warnings += [unsaved] if unsaved else []
        info = SourceInfo(
            format="deepspeed",
            zero_stage=stage,
            dp_world_size=dp,
            mp_world_size=as_int(head.get("mp_world_size") or 1, "mp_world_size"),
            dtype=dtype,
            ds_version=str(head.get("ds_version")),
            tag=self.files.tag,
            sub_group_size=None,
            ds_config=jsonable(ds_config),
            frozen_excluded=excluded,
            **counters,
        )
        return Facts(
            info=info,
            flavour=detection.flavour.name if detection.flavour else None,
            adam_w_mode=detection.adam_w_mode,
            step=max((s for s in group_steps if s is not None), default=None),
            groups=groups,
            params=params,
            tied=tied,
            buffer_names=buffer_names,
            warnings=warnings,
        )

    # -- tensors -----------------------------------------------------------------------------
    def _pieces(self, pname: str, pick: Any) -> Pieces:
        """One flat state of a parameter as its slices of the ranks' flat partitions, in order."""
        g, i = self._where[pname]
        parts = []
        for span in self._layouts_[g].spans(i):
            tf = self._optim[span.rank]
            parts.append(
                (tf, pick(tf.obj["optimizer_state_dict"], g).detach().narrow(0, span.partition_start, span.length))
            )
        return file_pieces(parts, self._shape[pname])

    def _whole_pieces(self, pname: str, key: str) -> Pieces:
        """A state kept whole per parameter (``Zero12Group.whole_slots``): the copy of the first rank
        holding it; every other rank's copy must be the same bytes, or the ranks come from different runs."""
        g, i = self._where[pname]
        layout = self._layouts_[g]
        numel = layout.numels[i]
        copies = []
        for rank, tf in enumerate(self._optim):
            slot = layout.whole_slots(rank).get(i)
            if slot is not None:
                flat = tf.obj["optimizer_state_dict"][_BASE]["state"][g][key].detach()
                copies.append((tf, flat.narrow(0, slot, numel)))
        for tf, copy in copies[1:]:
            if not torch.equal(copy, copies[0][1]):
                raise InputError(
                    f"{pname}: its {key} in {tf.path.name} differs from the copy in {copies[0][0].path.name} "
                    "(each rank keeps it whole, and they should agree): ranks from different saves are mixed"
                )
        return file_pieces(copies[:1], self._shape[pname])

    def _piece_state(self, name: str, moments: bool) -> PieceState:
        if name in self._frozen:
            return PieceState(fp32=Pieces.of(self._frozen[name].detach().to(torch.float32, copy=True)))
        if name not in self._where:
            raise InputError(f"parameter {name!r} is not in this checkpoint")
        step = self.facts.groups[self._where[name][0]].step
        fp32 = self._pieces(name, lambda block, g: block[_FP32][g])
        if self._zenflow:
            fp32 = self._newest(name, fp32)
        if not moments or not self._has_moments:
            return PieceState(fp32=fp32, step=step)
        g = self._where[name][0]
        optim = {
            key: (
                self._whole_pieces(name, key)
                if key in self._whole[g]
                else self._pieces(name, lambda block, g, key=key: block[_BASE]["state"][g][key])
            )
            for key in self._keys[g]
        }
        scalars = {k: v.clone() for k, v in self._scalars[g].items()}
        return PieceState(fp32=fp32, optim=optim, step=step, scalars=scalars)

    def _newest(self, name: str, master: Pieces) -> Pieces:
        """A ZenFlow run's master, with the module's weight where that is newer (``ucp.model.zenflow``)."""
        weight = module_weight(self._head(), name, self._shape[name], self._model_name())
        if weight is None:
            return master
        return Pieces.of(newest_master(master.join(), weight))

    @contextmanager
    def read_pieces(self, name: str, *, moments: bool = True) -> Iterator[PieceState]:
        """:meth:`read` without the copy: the universal writer streams the spans from the shards."""
        yield self._piece_state(name, moments)

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        return self._piece_state(name, moments).joined()

    def buffers(self) -> dict[str, torch.Tensor]:
        return module_buffers(self._head(), self._model_name())

    def extras(self) -> dict[str, Any]:
        return model_extras(self._head(), optimizer_block(self._optim[0]))

    def close(self) -> None:
        for tf in getattr(self, "_optim", []):
            tf.close()
        model = getattr(self, "_model", None)
        if model is not None:
            model.close()


def _claims_zero12(probe: Probe) -> bool:
    files = probe.deepspeed
    return (
        files is not None
        and not (files.stage3 or files.stage0 or files.layers or files.experts)
        and files.mp == 1
        and not probe.autoep
    )


def _open_zero12(probe: Probe, how: How) -> Reader:
    assert probe.deepspeed is not None  # claimed
    return Zero12Source(probe.deepspeed, optimizer=how.optimizer)


FORMAT = SourceFormat(
    name="deepspeed-zero12",
    label="DeepSpeed ZeRO-1/2 checkpoint",
    docs="format.md#2-deepspeed-zero-1-and-zero-2",
    claims=_claims_zero12,
    open=_open_zero12,
    family="deepspeed",
    describe=lambda facts: f"DeepSpeed {zero_label(facts.info.zero_stage)} checkpoint",
)
