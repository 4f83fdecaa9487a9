"""DeepSpeed ZeRO-3 checkpoints -> per-parameter state, streamed one parameter at a time.

Each rank's optim file holds, per sub-group, a flat fp32 buffer and Adam moments of the same
layout: the rank's ``ceil(numel/dp)`` partition of each member parameter, concatenated
(``ucp.model.partition``). ``param_shapes`` in the model-states files names the members of each
sub-group in order; the optimizer's param groups list which sub-groups each group owns.

An AutoEP run partitions its expert sub-groups over fewer ranks than its dense ones (``ds_zero_partition_groups``
says over which), so one reader can be limited to some param groups (``groups``) of some ranks' files (a
``files`` view), as :class:`~ucp.sources.zero12.Zero12Source` can.

A ZeRO-Infinity run (``offload_optimizer.device: nvme``) leaves the flat buffer and moments of each swapped
sub-group empty in its optim files; they are raw swap files under ``offloaded_tensors/`` (``ucp.io.rawfile``),
read in their place.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from ucp.deepspeed.fields import as_int, build_facts, jsonable, sub_group_size, tensor_shape
from ucp.deepspeed.layout import NVME_FOLDER, CheckpointFiles, optim_file
from ucp.deepspeed.model_states import (
    EXCLUDED_FROZEN_NOTE,
    engine_counters,
    frozen_excluded,
    mics_note,
    mics_replicas,
    model_dtype,
    model_extras,
    module_buffers,
    zero3_frozen_fragment,
)
from ucp.deepspeed.optim_states import optimizer_block
from ucp.errors import InputError
from ucp.io.rawfile import RawTensorFile
from ucp.io.torchfile import TorchFile
from ucp.model.detect import Detection, detect, mics_shard_size, offloads_to_nvme, unsaved_state_note
from ucp.model.flavours import Flavour
from ucp.model.partition import zero3_partition_size, zero3_rank_span
from ucp.model.pieces import FileSpan, Pieces
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, PieceState, Reader, SourceInfo, dtype_name
from ucp.sources.common import SpanSource, file_pieces, group_meta, zero3_gather, zero3_slices
from ucp.sources.format import How, Probe, SourceFormat
from ucp.sources.zero3_nvme import SwapFiles, swap_in
from ucp.sources.zero3_rank_files import (
    RANK_MODEL_KEYS,
    Inner,
    check_model_rank,
    check_models,
    check_partitions,
    check_scalers,
    check_stage_and_ranks,
    flat_groups,
    inner_state,
    sub_group_layout,
)
from ucp.sources.zero3_sub_groups import Where, place, sub_group_state

__all__ = ["FORMAT", "Zero3Source"]

logger = logging.getLogger(__name__)


class Zero3Source(Reader):
    """A ZeRO-3 checkpoint as a :class:`~ucp.model.records.Reader` (one mp rank).

    ``groups``: read only these param groups (the others keep no members), whose sub-groups must then be
    partitioned over exactly the files of ``files``, in order, where the save records its partition groups;
    ``frozen=False`` leaves the frozen parameters to another reader (they are partitioned over every rank).
    """

    streams = True

    def __init__(
        self,
        files: CheckpointFiles,
        *,
        optimizer: str | None = None,
        mp_rank: int = 0,
        groups: Collection[int] | None = None,
        frozen: bool = True,
    ) -> None:
        self.files = files
        self.mp_rank = mp_rank
        self._only = None if groups is None else frozenset(groups)
        self._with_frozen = frozen
        self._optim: list[TorchFile] = []
        self._model: list[TorchFile] = []
        # ZeRO-Infinity: (rank, sub-group, state key or None for the masters) -> its NVMe swap file
        self._swap: SwapFiles = {}
        # (sub-group, state key or None) -> where each rank's whole flat buffer lies in its file (None: not as fp32 bytes)
        self._flat_spans: dict[tuple[int, str | None], list[FileSpan | None]] = {}

        def build() -> Facts:
            # rank by rank: each model-states file repeats the module dict, read once and re-bound after
            self._optim = TorchFile.open_all(files.optim[mp_rank])
            self._model = TorchFile.open_all(files.model[mp_rank], each=check_model_rank, keep=RANK_MODEL_KEYS)
            facts = self._facts(optimizer)
            self._trim_head()
            return facts

        self.facts = build_facts(
            build, close=self.close, where=f"{files.tag_dir}: the rank files are not a ZeRO-3 checkpoint ucp can read"
        )

    def _trim_head(self) -> None:
        """Once the facts are read: rank 0's model-states tree keeps what :meth:`buffers` and :meth:`extras` read
        (its module's buffers, not a placeholder tensor per parameter, and no ``param_shapes``): 10^5 of each for
        a MoE, held to the end of a reshard for nothing."""
        head = self._model[0].obj
        if not isinstance(head, Mapping):
            return
        module = head.get("module")
        kept = {k: v for k, v in head.items() if k not in ("module", "param_shapes")}
        if isinstance(module, Mapping):
            kept["module"] = {n: module[n] for n in head.get("buffer_names") or [] if n in module}
        self._model[0].obj = kept

    # -- facts -------------------------------------------------------------------------------
    def _rank_file(self, dp_rank: int) -> str:
        return optim_file(dp_rank, self.mp_rank, bf16=self.files.bf16_prefix)

    def _reads(self, group: int) -> bool:
        return self._only is None or group in self._only

    def _facts(self, optimizer: str | None) -> Facts:
        blocks = [optimizer_block(tf) for tf in self._optim]
        check_stage_and_ranks(self._optim, blocks, self._rank_file, self.files.tag_dir, limited=self._only is not None)
        models = check_models(self._model, self._optim)
        head = models[0]
        shapes = head["param_shapes"]
        ds_config = head.get("ds_config") or {}
        if not isinstance(ds_config, Mapping):
            raise InputError(f"{self._model[0].path.name}: ds_config is a {type(ds_config).__name__}, not a dict")
        check_scalers(self._optim, blocks)
        inners = [inner_state(tf, block) for tf, block in zip(self._optim, blocks)]
        groups_raw = inners[0][0]
        layout = sub_group_layout(self._optim, inners)
        check_partitions(self._optim, blocks, [sub for g, subs in enumerate(layout) if self._reads(g) for sub in subs])
        detection = detect(blocks[0]["optimizer_state_dict"], ds_config, optimizer or self.files.reset_flavour)
        flat = flat_groups(self._optim, blocks, len(shapes))
        if offloads_to_nvme(ds_config):
            inners = swap_in(self._optim, self.files.tag_dir, flat, inners, shapes, self._swap)
        self._where, sub_of_group = place(layout, shapes, flat, self._reads)
        derived = detection.flavour.derived if detection.flavour else ()
        subs_read = [sub for sub in range(len(shapes)) if self._reads(sub_of_group[sub])]
        state = sub_group_state(self._optim, inners, flat, subs_read, ds_config, derived)
        self._has_moments, self._keys, self._scalars = state.has_moments, state.keys, state.scalars
        sub_steps = self._sub_steps(groups_raw, sub_of_group, inners, detection)
        self._steps = {name: sub_steps[w.sub_group] for name, w in self._where.items()}
        dtype = model_dtype(head, shapes, files_bf16=self.files.bf16_prefix)
        params, groups = self._groups(groups_raw, layout, shapes, sub_steps, detection, dtype)
        params += self._frozen_params(head, dtype)
        tied = head.get("shared_params") or {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in tied.items()):
            raise InputError(f"{self._model[0].path.name}: shared_params maps names that are not strings")
        steps = [s for s in self._steps.values() if s is not None]
        replicas = mics_replicas(head, ds_config, len(self._optim), self._model[0].path.name)
        notes = [EXCLUDED_FROZEN_NOTE] if frozen_excluded(head, 3) else []
        swapped = {sub for _, sub, key in self._swap if key is None}
        if swapped:
            notes.append(
                f"ZeRO-Infinity: the masters and optimizer state of {len(swapped)} of {len(shapes)} sub-groups are "
                f"read from the NVMe swap files in {NVME_FOLDER}/"
            )
        if replicas > 1 or mics_shard_size(ds_config):
            notes.append(mics_note(mics_shard_size(ds_config), replicas))
        info = self._info(head, ds_config, dtype, replicas)
        notes += _per_call_counts(detection.flavour, groups, info.global_steps - info.skipped_steps)
        applied = info.global_steps - info.skipped_steps
        unsaved = None if self._has_moments else unsaved_state_note(ds_config, applied, self.files.reset_flavour)
        notes += [unsaved] if unsaved else []
        return Facts(
            info=info,
            flavour=detection.flavour.name if detection.flavour else None,
            adam_w_mode=detection.adam_w_mode,
            step=max(steps, default=None),
            groups=groups,
            params=params,
            tied=dict(tied),
            buffer_names=list(head.get("buffer_names") or []),
            warnings=detection.warnings + notes,
        )

    def _sub_steps(
        self,
        groups_raw: list[Mapping[str, Any]],
        sub_of_group: dict[int, int],
        inners: list[Inner],
        detection: Detection,
    ) -> dict[int, int | None]:
        """The step of each sub-group, checked across ranks (the highest wins, with a warning)."""
        sub_steps: dict[int, int | None] = {}
        for sub in range(len(self._keys)):
            if not self._reads(sub_of_group[sub]):
                sub_steps[sub] = None
                continue
            group = groups_raw[sub_of_group[sub]]
            seen: set[int | None] = set()
            for _, rank_state in inners:
                entry = rank_state.get(sub, {})
                seen.add(detection.flavour.read_step(group, entry) if detection.flavour else None)
            if len(seen) > 1:
                detection.warnings.append(f"sub-group {sub} has different steps across ranks: {sorted(map(str, seen))}")
            sub_steps[sub] = max((s for s in seen if s is not None), default=None)
        return sub_steps

    def _groups(
        self,
        groups_raw: list[Mapping[str, Any]],
        layout: list[list[int]],
        shapes: list[Mapping[str, Any]],
        sub_steps: dict[int, int | None],
        detection: Detection,
        dtype: str,
    ) -> tuple[list[ParamMeta], list[GroupMeta]]:
        """The optimized parameters in group order, and each group's metadata."""
        params: list[ParamMeta] = []
        groups: list[GroupMeta] = []
        for g, group in enumerate(groups_raw):
            names: list[str] = []
            subs = layout[g] if self._reads(g) else []
            for sub in subs:
                for name in shapes[sub]:
                    names.append(name)
                    params.append(ParamMeta(name, self._where[name].shape, dtype, g, False))
            member_steps = [s for s in (sub_steps[sub] for sub in subs) if s is not None]
            keys = {self._keys[s] for s in subs}
            if len(keys) > 1:
                raise InputError(f"the sub-groups of param group {g} hold different optimizer state {sorted(keys)}")
            step = max(member_steps, default=None)
            groups.append(group_meta(g, group, names, step, detection.adam_w_mode, keys.pop() if keys else ()))
        return params, groups

    def _frozen_params(self, head: Mapping[str, Any], dtype: str) -> list[ParamMeta]:
        frozen_shapes = (head.get("frozen_param_shapes") or {}) if self._with_frozen else {}
        self._frozen: dict[str, tuple[int, ...]] = {}
        params = []
        for name, raw_shape in frozen_shapes.items():
            if name in self._where:
                raise InputError(f"parameter {name!r} is listed both as optimized and as frozen")
            shape = tensor_shape(raw_shape)
            self._frozen[name] = shape
            self._check_fragments(name, shape)
            fragment = (head.get("frozen_param_fragments") or {}).get(name)
            frozen_dtype = dtype_name(fragment.dtype) if torch.is_tensor(fragment) else dtype
            params.append(ParamMeta(name, shape, frozen_dtype, None, True))
        return params

    def _info(self, head: Mapping[str, Any], ds_config: Mapping[str, Any], dtype: str, replicas: int) -> SourceInfo:
        return SourceInfo(
            format="deepspeed",
            zero_stage=3,
            dp_world_size=len(self._optim),
            mp_world_size=as_int(head.get("mp_world_size") or 1, "mp_world_size"),
            dtype=dtype,
            ds_version=str(head.get("ds_version")),
            tag=self.files.tag,
            sub_group_size=sub_group_size(ds_config),
            ds_config=jsonable(ds_config),
            frozen_excluded=frozen_excluded(head, 3),
            replicas=replicas,
            **engine_counters(head),
        )

    def _check_fragments(self, name: str, shape: tuple[int, ...]) -> None:
        """Every rank must hold its piece of a frozen parameter (checked here, before any output)."""
        numel, dp = math.prod(shape), len(self._model)
        for rank, tf in enumerate(self._model):
            start, end = zero3_rank_span(numel, dp, rank)
            if end > start:
                zero3_frozen_fragment(tf, name, numel, dp, rank)

    # -- tensors -----------------------------------------------------------------------------
    def _fragment(self, rank: int, sub: int, key: str | None) -> tuple[TorchFile | RawTensorFile, torch.Tensor]:
        """A rank's flat masters (``key`` None) or state ``key`` of a sub-group, and the file holding it."""
        swap = self._swap.get((rank, sub, key))
        if swap is not None:
            return swap, swap.tensor
        tf = self._optim[rank]
        block = tf.obj["optimizer_state_dict"]
        return tf, block["fp32_flat_groups"][sub] if key is None else block["optimizer_state_dict"]["state"][sub][key]

    def _flat_spans_of(self, sub: int, key: str | None) -> list[FileSpan | None]:
        """Where each rank's whole flat fp32 buffer of a sub-group lies in its file (None where it is not fp32 bytes of
        its file), found once per buffer: each member's slice is then an offset into it (10^5 parameters x ranks x
        states would otherwise each make and measure tensor views, a third of a to-universal's CPU at 10^4
        tensors)."""
        found = self._flat_spans.get((sub, key))
        if found is None:
            found = []
            for rank in range(len(self._optim)):
                holder, tensor = self._fragment(rank, sub, key)
                flat = tensor.detach()
                found.append(holder.span(flat) if flat.dtype == torch.float32 and flat.dim() == 1 else None)
            self._flat_spans[(sub, key)] = found  # the same answer whichever thread gets here first
        return found

    def _pieces(self, where: Where, key: str | None) -> Pieces:
        """One flat state of a parameter as its rank slices, each where it lies in its shard on disk."""
        dp, numel, item = len(self._optim), where.numel, 4
        size = zero3_partition_size(numel, dp)
        skip, reach = where.offset * item, (where.offset + where.size) * item
        spans: list[FileSpan] = []
        for rank, base in enumerate(self._flat_spans_of(where.sub_group, key)):
            start = rank * size
            if start >= numel:
                break  # the ceil split leaves only trailing ranks empty
            if base is None or reach > base.nbytes:
                return self._tensor_pieces(where, key)
            spans.append(FileSpan(base.file, base.offset + skip, (min(start + size, numel) - start) * item))
        return Pieces(tuple(spans), where.shape, torch.float32)

    def _tensor_pieces(self, where: Where, key: str | None) -> Pieces:
        """:meth:`_pieces` from tensor views: buffers that are not fp32 bytes of their file (a low-precision
        state, a legacy file) are sliced as tensors and converted."""
        files: list[SpanSource] = []

        def fragment_of(rank: int) -> torch.Tensor:
            holder, tensor = self._fragment(rank, where.sub_group, key)
            files.append(holder)
            return tensor.detach().narrow(0, where.offset, where.size)

        slices = zero3_slices(fragment_of, where.numel, len(self._optim))
        return file_pieces(zip(files, slices), where.shape)

    @contextmanager
    def read_pieces(self, name: str, *, moments: bool = True) -> Iterator[PieceState]:
        """:meth:`read` without the copy: each tensor as the spans of the shards that hold it, for a
        writer to stream from disk (valid inside the ``with`` block; here, until :meth:`close`)."""
        yield self._piece_state(name, moments)

    def _piece_state(self, name: str, moments: bool) -> PieceState:
        if name in self._frozen:
            return PieceState(fp32=Pieces.of(self._frozen_tensor(name)))
        where = self._where.get(name)
        if where is None:
            raise InputError(f"parameter {name!r} is not in this checkpoint")
        sub = where.sub_group
        fp32 = self._pieces(where, None)
        if not moments or not self._has_moments:
            return PieceState(fp32=fp32, step=self._steps.get(name))
        optim = {key: self._pieces(where, key) for key in self._keys[sub]}
        scalars = {k: v.clone() for k, v in self._scalars[sub].items()}
        return PieceState(fp32=fp32, optim=optim, step=self._steps.get(name), scalars=scalars)

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        return self._piece_state(name, moments).joined()

    def _frozen_tensor(self, name: str) -> torch.Tensor:
        shape = self._frozen[name]
        numel, dp = math.prod(shape), len(self._model)
        return zero3_gather(
            lambda rank: zero3_frozen_fragment(self._model[rank], name, numel, dp, rank), numel, shape, dp
        )

    def buffers(self) -> dict[str, torch.Tensor]:
        return module_buffers(self._model[0].obj, self._model[0].path.name)

    def extras(self) -> dict[str, Any]:
        return model_extras(self._model[0].obj, optimizer_block(self._optim[0]))

    def close(self) -> None:
        for tf in getattr(self, "_optim", []) + getattr(self, "_model", []):
            tf.close()
        for raw in getattr(self, "_swap", {}).values():
            raw.close()


#: What a damaged or hand-made file can make the code past the explicit checks raise.


def _per_call_counts(flavour: Flavour | None, groups: list[GroupMeta], taken: int) -> list[str]:
    """A note where an optimizer counting its steps in the param group (Apex, schedule-free) counted more than
    the engine took: ZeRO-3 calls ``optimizer.step()`` once per sub-group, and every call counts in every group."""
    if flavour is None or flavour.step_in_state or not flavour.step_in_group:
        return []
    over = sorted({g.step for g in groups if g.step is not None and g.step > taken})
    if not over:
        return []
    return [
        f"the param groups count {', '.join(map(str, over))} steps where the engine took {taken}: DeepSpeed's "
        f"ZeRO-3 calls the optimizer once per sub-group and {flavour.name} counts every call in each param group "
        "(carried as counted; a ZeRO-3 run goes on counting so, a ZeRO-1/2 run one per step)"
    ]


def _claims_zero3(probe: Probe) -> bool:
    files = probe.deepspeed
    return files is not None and files.stage3 and files.mp == 1 and not files.layers and not probe.autoep


def _open_zero3(probe: Probe, how: How) -> Reader:
    """A ZeRO-3 save; a ZenFlow run's matrices read back in the model's shape (it saves them transposed)."""
    from ucp.model.zenflow import ZENFLOW_Z3_NOTE, ZenflowTransposed, transposes_matrices

    assert probe.deepspeed is not None  # claimed
    source = Zero3Source(probe.deepspeed, optimizer=how.optimizer)
    if transposes_matrices(source.facts.info.ds_config, 3):
        return ZenflowTransposed(source, note=ZENFLOW_Z3_NOTE, owns=True)
    return source


FORMAT = SourceFormat(
    name="deepspeed-zero3",
    label="DeepSpeed ZeRO-3 checkpoint",
    docs="format.md#1-deepspeed-zero-3",
    claims=_claims_zero3,
    open=_open_zero3,
    family="deepspeed",
)
