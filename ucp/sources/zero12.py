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
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ucp.deepspeed.fields import (
    as_int,
    build_facts,
    check_one_version,
    jsonable,
    need_mapping,
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
    optimizer_block,
    zero12_layouts,
)
from ucp.errors import InputError
from ucp.io import descriptors
from ucp.io.torchfile import TorchFile
from ucp.model.detect import Detection, detect, offloads_optimizer, round_robin_gradients, unsaved_state_note
from ucp.model.options import zero_label
from ucp.model.partition import Zero12Group, round_robin_order, zero12_group
from ucp.model.pieces import Pieces
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, PieceState, Reader, SourceInfo, dtype_name
from ucp.model.zenflow import ZENFLOW_NOTE, ZENFLOW_OVERLAP_NOTE, newest_master, zenflow_config
from ucp.sources.common import group_meta
from ucp.sources.format import How, Probe, SourceFormat
from ucp.sources.zero12_partitions import check_group_sizes, group_steps, partition_pieces, whole_pieces
from ucp.sources.zero12_rank_files import (
    BASE_STATE,
    FP32_PARTITIONS,
    base_state,
    check_param_groups,
    check_ranks,
    has_moments,
    mapped_shapes,
    zero12_stage,
)

__all__ = ["FORMAT", "Zero12Source"]

logger = logging.getLogger(__name__)


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
            descriptors.reserve(len(files.optim[mp_rank]) + 1, f"the save in {files.tag_dir}")
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

    def _check_model(self) -> Mapping[str, Any]:
        assert self._model is not None
        name = self._model.path.name
        head = self._head()
        check_model_states(head, name, "not a ZeRO-1/2 model-states file (saved without optimizer state?)")
        stamped = [head] + [tf.obj for tf in self._optim if isinstance(tf.obj, Mapping)]
        stamped += [optimizer_block(tf) for tf in self._optim]
        check_one_version(stamped)
        return head

    def _layouts(self, shapes: list[Mapping[str, Any]], blocks: list[Mapping[str, Any]]) -> list[Zero12Group]:
        paddings = blocks[0].get("param_alignment_paddings")
        return zero12_layouts(shapes, paddings, len(self._optim), self._optim[0].path.name)

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
            self._fields["param_shapes"] = mapped_shapes(self._optim, blocks, self._shapes_of, self._model_name())
        head = self._check_model()
        stage, self._kind, stage0 = zero12_stage(self._optim, blocks, head, self._model_name(), self.files.tag_dir)
        check_ranks(self._optim, blocks, head, self._rank_file, self.files.tag_dir, self._only, self._model_name())
        shapes = [need_mapping(g, "param_shapes entry") for g in head["param_shapes"]]
        ds_config = head.get("ds_config") or {}
        bases = [base_state(tf, block) for tf, block in zip(self._optim, blocks)]
        groups_raw = bases[0][0]
        check_param_groups(self._optim, blocks, bases, shapes)
        self._has_moments = has_moments(self._optim, bases)
        self._layouts_ = self._layouts(shapes, blocks)
        self._flat_names = [list(g) for g in shapes]
        self._round_robin = self._kind == "zero" and dp > 1 and round_robin_gradients(ds_config)
        detection = detect(blocks[0][BASE_STATE], ds_config, optimizer or self.files.reset_flavour)
        offload = offloads_optimizer(ds_config)
        flavour = detection.flavour
        self._whole = [flavour.zero12_whole_keys(g, offload=offload) if flavour else () for g in groups_raw]
        sizes = check_group_sizes(
            self._optim,
            shapes,
            blocks,
            self._layouts_,
            [s for _, s in bases],
            reads=self._reads,
            whole_keys=self._whole,
            derived=flavour.derived if flavour else (),
            original_layout=self._original_layout,
        )
        self._keys, self._scalars = sizes.keys, sizes.scalars
        steps = group_steps(groups_raw, bases, detection)
        dtype = model_dtype(head, shapes, files_bf16=self.files.bf16_prefix)
        params, groups = self._groups(groups_raw, shapes, steps, detection, dtype)
        tied = module_ties(head, self._where)
        buffer_names = list(head.get("buffer_names") or [])
        self._frozen: dict[str, torch.Tensor] = {}
        for pname, value in zero12_frozen_values(head, self._where, tied, buffer_names, self._model_name()).items():
            if pname in self._where:
                raise InputError(f"parameter {pname!r} is listed both as optimized and as frozen")
            self._frozen[pname] = value
            params.append(ParamMeta(pname, tuple(value.shape), dtype_name(value.dtype), None, True))
        excluded = frozen_excluded(head, stage)
        zenflow = zenflow_config(ds_config)
        self._zenflow = zenflow is not None
        counters = engine_counters(head)
        warnings = self._notes(detection, ds_config, excluded, zenflow, stage0, counters)
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
            step=max((s for s in steps if s is not None), default=None),
            groups=groups,
            params=params,
            tied=tied,
            buffer_names=buffer_names,
            warnings=warnings,
        )

    def _notes(
        self,
        detection: Detection,
        ds_config: Mapping[str, Any],
        excluded: bool,
        zenflow: Mapping[str, Any] | None,
        stage0: bool,
        counters: Mapping[str, Any],
    ) -> list[str]:
        """The facts' warnings: the flavour's, then excluded frozen parameters, ZenFlow, stage 0, unsaved state."""
        warnings = list(detection.warnings) + ([EXCLUDED_FROZEN_NOTE] if excluded else [])
        if zenflow is not None:
            warnings += [ZENFLOW_NOTE] + ([ZENFLOW_OVERLAP_NOTE] if zenflow.get("overlap_step") is True else [])
        if stage0:
            warnings.append(
                "written by BF16_Optimizer without ZeRO (stage 0); its optimizer state is partitioned "
                "like ZeRO-1, so ucp reads it as stage 1"
            )
        unsaved = (
            None
            if self._has_moments
            else unsaved_state_note(
                ds_config, counters["global_steps"] - counters["skipped_steps"], self.files.reset_flavour
            )
        )
        return warnings + ([unsaved] if unsaved else [])

    # -- tensors -----------------------------------------------------------------------------
    def _pieces(self, pname: str, pick: Any) -> Pieces:
        """One flat state of a parameter as its slices of the ranks' flat partitions, in order."""
        g, i = self._where[pname]
        return partition_pieces(self._optim, self._layouts_[g], g, i, self._shape[pname], pick)

    def _whole_pieces(self, pname: str, key: str) -> Pieces:
        """A state kept whole per parameter: the first rank's copy, checked equal to every other rank's."""
        g, i = self._where[pname]
        return whole_pieces(self._optim, self._layouts_[g], g, i, key, self._shape[pname], pname)

    def _piece_state(self, name: str, moments: bool) -> PieceState:
        if name in self._frozen:
            return PieceState(fp32=Pieces.of(self._frozen[name].detach().to(torch.float32, copy=True)))
        if name not in self._where:
            raise InputError(f"parameter {name!r} is not in this checkpoint")
        step = self.facts.groups[self._where[name][0]].step
        fp32 = self._pieces(name, lambda block, g: block[FP32_PARTITIONS][g])
        if self._zenflow:
            fp32 = self._newest(name, fp32)
        if not moments or not self._has_moments:
            return PieceState(fp32=fp32, step=step)
        g = self._where[name][0]
        optim = {
            key: (
                self._whole_pieces(name, key)
                if key in self._whole[g]
                else self._pieces(name, lambda block, g, key=key: block[BASE_STATE]["state"][g][key])
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
