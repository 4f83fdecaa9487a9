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
import re
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ucp.deepspeed.autoep import PARTITION_GROUPS, partition_of
from ucp.deepspeed.fields import (
    as_int,
    build_facts,
    check_one_version,
    jsonable,
    need_list,
    need_mapping,
    need_tensor,
    sub_group_size,
    tensor_shape,
)
from ucp.deepspeed.layout import NVME_FOLDER, CheckpointFiles, nvme_swap_file, optim_file
from ucp.deepspeed.model_states import (
    EXCLUDED_FROZEN_NOTE,
    check_model_states,
    engine_counters,
    frozen_excluded,
    mics_note,
    mics_replicas,
    model_dtype,
    model_extras,
    module_buffers,
    zero3_frozen_fragment,
)
from ucp.deepspeed.optim_states import (
    check_rank_count,
    check_scaler_fields,
    flat_state_keys,
    optimizer_block,
    rank_scalars,
    stage_of,
)
from ucp.errors import InputError
from ucp.io.rawfile import RawTensorFile
from ucp.io.torchfile import TorchFile
from ucp.model.detect import (
    Detection,
    detect,
    mics_shard_size,
    offloads_to_nvme,
    partial_offload_ratio,
    unsaved_state_note,
)
from ucp.model.flavours import Flavour
from ucp.model.partition import zero3_partition_size, zero3_rank_span
from ucp.model.pieces import Pieces
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, PieceState, Reader, SourceInfo, dtype_name
from ucp.sources.common import SpanSource, file_pieces, group_meta, zero3_gather, zero3_slices
from ucp.sources.format import How, Probe, SourceFormat

__all__ = ["FORMAT", "Zero3Source"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Where:
    sub_group: int
    offset: int
    size: int
    numel: int
    shape: tuple[int, ...]


def _sub_numel(members: Mapping[str, Any], dp: int) -> int:
    """A sub-group's elements on each rank: its members' ZeRO-3 partitions."""
    return sum(zero3_partition_size(math.prod(tensor_shape(shape)), dp) for shape in members.values())


_DS_ID = re.compile(r"\d+_\d+")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


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
        self._swap: dict[tuple[int, int, str | None], RawTensorFile] = {}

        def build() -> Facts:
            # rank by rank: each model-states file repeats the module dict, read once and re-bound after
            self._optim = TorchFile.open_all(files.optim[mp_rank])
            self._model = TorchFile.open_all(files.model[mp_rank])
            return self._facts(optimizer)

        self.facts = build_facts(
            build, close=self.close, where=f"{files.tag_dir}: the rank files are not a ZeRO-3 checkpoint ucp can read"
        )

    # -- facts -------------------------------------------------------------------------------
    def _rank_file(self, dp_rank: int) -> str:
        return optim_file(dp_rank, self.mp_rank, bf16=self.files.bf16_prefix)

    def _check_rank_count(self, blocks: list[Mapping[str, Any]]) -> None:
        for tf, block in zip(self._optim, blocks):
            try:
                stage = stage_of(block)
            except InputError as err:
                raise InputError(f"{tf.path.name}: {err}") from None
            if stage != 3:
                raise InputError(
                    f"{tf.path.name} says zero_stage={stage}, but its folder holds ZeRO-3 model files "
                    "(per-rank zero_pp_rank_*_model_states.pt); the checkpoint mixes stages"
                )
            if self._only is None or PARTITION_GROUPS not in block:  # else checked by _check_partitions
                check_rank_count(
                    block, tf.path.name, [t.path.name for t in self._optim], self._rank_file, self.files.tag_dir
                )

    def _reads(self, group: int) -> bool:
        return self._only is None or group in self._only

    def _check_partitions(self, blocks: list[Mapping[str, Any]], subs: list[int]) -> None:
        """Where the save records each sub-group's partition group (AutoEP), every sub-group read must be
        partitioned over exactly the files read, file i holding partition i."""
        for i, (tf, block) in enumerate(zip(self._optim, blocks)):
            for sub in subs:
                part = partition_of(block, sub, tf.path.name)
                if part is not None and (part.count, part.rank) != (len(self._optim), i):
                    raise InputError(
                        f"{tf.path.name}: sub-group {sub} is partition {part.rank} of {part.count} (ranks "
                        f"{list(part.ranks)}), but it is read as {i} of {len(self._optim)} files: a rank file is "
                        "missing or extra, or the files are another group's (AutoEP experts: their expert-data-"
                        "parallel ranks)"
                    )

    def _check_models(self) -> list[Mapping[str, Any]]:
        models = []
        for tf in self._model:
            obj = tf.obj
            check_model_states(obj, tf.path.name, "not a ZeRO-3 model-states file")
            models.append(obj)
        head, first = models[0], self._model[0].path.name
        stamped = models + [tf.obj for tf in self._optim if isinstance(tf.obj, Mapping)]
        check_one_version(stamped)
        counters = engine_counters(head)
        for tf, model in zip(self._model[1:], models[1:]):
            other = engine_counters(model)
            for key in ("global_steps", "global_samples", "skipped_steps"):
                if other[key] != counters[key]:
                    raise InputError(
                        f"{tf.path.name} is at {key}={other[key]} but {first} is at {counters[key]}: "
                        "rank files from different saves (tags) are mixed in one folder"
                    )
        shapes = head["param_shapes"]
        if any(m["param_shapes"] != shapes for m in models[1:]):
            raise InputError("model-states files disagree on param_shapes: ranks from different runs are mixed")
        frozen = {k: tensor_shape(v) for k, v in (head.get("frozen_param_shapes") or {}).items()}
        for tf, model in zip(self._model[1:], models[1:]):
            theirs = {k: tensor_shape(v) for k, v in (model.get("frozen_param_shapes") or {}).items()}
            if theirs != frozen:
                raise InputError(
                    f"{tf.path.name} and {first} disagree on frozen_param_shapes: ranks from different runs are mixed"
                )
        return models

    def _inner(self, tf: TorchFile, block: Mapping[str, Any]) -> tuple[list[Mapping[str, Any]], Mapping[Any, Any]]:
        """The torch optimizer state inside a ZeRO block: its param groups and per-sub-group state."""
        name = tf.path.name
        inner = need_mapping(block.get("optimizer_state_dict"), f"{name}: optimizer_state_dict.optimizer_state_dict")
        groups = [
            need_mapping(g, f"{name}: a param group")
            for g in need_list(inner.get("param_groups") or [], f"{name}: param_groups")
        ]
        for g, group in enumerate(groups):
            for sub in need_list(group.get("params", []), f"{name}: param group {g} params"):
                as_int(sub, f"{name}: param group {g} params entry")
        state = need_mapping(inner.get("state") or {}, f"{name}: optimizer state")
        return groups, state

    def _facts(self, optimizer: str | None) -> Facts:
        blocks = [optimizer_block(tf) for tf in self._optim]
        self._check_rank_count(blocks)
        models = self._check_models()
        head = models[0]
        shapes = head["param_shapes"]
        ds_config = head.get("ds_config") or {}
        if not isinstance(ds_config, Mapping):
            raise InputError(f"{self._model[0].path.name}: ds_config is a {type(ds_config).__name__}, not a dict")
        self._check_scalers(blocks)
        inners = [self._inner(tf, block) for tf, block in zip(self._optim, blocks)]
        groups_raw = inners[0][0]
        layout = self._layout(inners)
        self._check_partitions(blocks, [sub for g, subs in enumerate(layout) if self._reads(g) for sub in subs])
        detection = detect(blocks[0]["optimizer_state_dict"], ds_config, optimizer or self.files.reset_flavour)
        flat = self._flat(blocks, len(shapes))
        if offloads_to_nvme(ds_config):
            inners = self._swap_in(flat, inners, shapes)
        sub_of_group = self._place(layout, shapes, flat)
        self._derived = detection.flavour.derived if detection.flavour else ()
        self._collect_keys(
            inners, flat, [sub for sub in range(len(shapes)) if self._reads(sub_of_group[sub])], ds_config
        )
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

    def _check_scalers(self, blocks: list[Mapping[str, Any]]) -> None:
        for tf, block in zip(self._optim, blocks):
            check_scaler_fields(block, tf.path.name)

    def _layout(self, inners: list[tuple[list[Mapping[str, Any]], Mapping[Any, Any]]]) -> list[list[int]]:
        """The sub-groups of each param group, the same on every rank."""
        layout = [[int(s) for s in g.get("params", [])] for g in inners[0][0]]
        for tf, (rank_groups, _) in zip(self._optim[1:], inners[1:]):
            if [[int(s) for s in g.get("params", [])] for g in rank_groups] != layout:
                raise InputError(
                    f"{tf.path.name} and {self._optim[0].path.name} group their sub-groups differently: "
                    "ranks from different runs are mixed"
                )
        return layout

    def _swap_in(
        self,
        flat: list[list[torch.Tensor]],
        inners: list[tuple[list[Mapping[str, Any]], Mapping[Any, Any]]],
        shapes: list[Mapping[str, Any]],
    ) -> list[tuple[list[Mapping[str, Any]], Mapping[Any, Any]]]:
        """ZeRO-Infinity (``offload_optimizer.device: nvme``) saves a sub-group large enough to swap (1 MiB at
        least, per rank) as an empty flat tensor and empty state tensors: its masters and moments are the
        swap files DeepSpeed copies into the tag folder. Put those files' tensors in their place (``flat``
        in place; returns ``inners`` with their state), each a view on its file."""
        out: list[tuple[list[Mapping[str, Any]], Mapping[Any, Any]]] = []
        for rank, (groups, rank_state) in enumerate(inners):
            state = dict(rank_state)
            for sub, members in enumerate(shapes):
                numel = _sub_numel(members, len(flat))
                if flat[rank][sub].numel() or not numel:
                    continue
                ds_id = getattr(flat[rank][sub], "ds_id", None)
                name = self._optim[rank].path.name
                if not isinstance(ds_id, str) or not _DS_ID.fullmatch(ds_id):
                    raise InputError(
                        f"{name}: sub-group {sub} is swapped to NVMe, but its flat tensor names no swap file "
                        f"(ds_id {ds_id!r})"
                    )
                what = f"rank {rank}'s sub-group {sub} is in NVMe swap files (DeepSpeed copies them to {NVME_FOLDER}/)"
                flat[rank][sub] = self._open_swap(rank, sub, ds_id, None, flat[rank][sub].dtype, numel, what)
                entry = state.get(sub)
                if isinstance(entry, Mapping):
                    swapped = dict(entry)
                    for key, value in entry.items():
                        if torch.is_tensor(value) and value.dim() == 1 and not value.numel():
                            if not isinstance(key, str) or not _KEY.fullmatch(key):
                                raise InputError(f"{name}: sub-group {sub} has a state named {key!r}")
                            swapped[key] = self._open_swap(rank, sub, ds_id, key, value.dtype, numel, what)
                    state[sub] = swapped
            out.append((groups, state))
        return out

    def _open_swap(
        self, rank: int, sub: int, ds_id: str, key: str | None, dtype: torch.dtype, numel: int, what: str
    ) -> torch.Tensor:
        raw = RawTensorFile(nvme_swap_file(self.files.tag_dir, rank, ds_id, key), dtype, numel, what=what)
        self._swap[(rank, sub, key)] = raw
        return raw.tensor

    def _flat(self, blocks: list[Mapping[str, Any]], subs: int) -> list[list[torch.Tensor]]:
        """Each rank's flat fp32 buffer per sub-group, checked to be flat tensors."""
        flat = [
            need_list(b.get("fp32_flat_groups"), f"{tf.path.name}: fp32_flat_groups")
            for tf, b in zip(self._optim, blocks)
        ]
        for tf, rank_flat in zip(self._optim, flat):
            if len(rank_flat) != subs:
                raise InputError(
                    f"{tf.path.name} holds fp32_flat_groups for {len(rank_flat)} sub-groups, but "
                    f"param_shapes has {subs}"
                )
            for sub, tensor in enumerate(rank_flat):
                need_tensor(tensor, f"{tf.path.name}: fp32_flat_groups[{sub}]")
                if tensor.dim() != 1:
                    raise InputError(
                        f"{tf.path.name}: fp32_flat_groups[{sub}] has shape {tuple(tensor.shape)}; "
                        "expected a flat buffer"
                    )
        return flat

    def _place(
        self, layout: list[list[int]], shapes: list[Mapping[str, Any]], flat: list[list[torch.Tensor]]
    ) -> dict[int, int]:
        """Where every optimized parameter sits (``self._where``); returns each sub-group's param group."""
        self._where: dict[str, _Where] = {}
        sub_of_group: dict[int, int] = {}
        for g, subs in enumerate(layout):
            for sub in subs:
                if not 0 <= sub < len(shapes):
                    raise InputError(f"param group {g} names sub-group {sub}, but param_shapes has {len(shapes)}")
                if sub in sub_of_group:
                    raise InputError(f"sub-group {sub} belongs to param groups {sub_of_group[sub]} and {g}")
                sub_of_group[sub] = g
        for sub, members in enumerate(shapes):
            if sub in sub_of_group and not self._reads(sub_of_group[sub]):
                continue  # partitioned over other ranks: another reader places it
            offset = 0
            for name, raw_shape in members.items():
                shape = tensor_shape(raw_shape)
                numel = 1
                for d in shape:
                    numel *= d
                size = zero3_partition_size(numel, len(flat))
                if name in self._where:
                    raise InputError(f"parameter {name!r} appears twice in param_shapes")
                self._where[name] = _Where(sub, offset, size, numel, shape)
                offset += size
            for rank, rank_flat in enumerate(flat):
                have = rank_flat[sub].numel()
                if have != offset:
                    raise InputError(
                        f"sub-group {sub} on rank {rank} holds {have} elements, but its parameters' "
                        f"partitions add up to {offset} at dp={len(flat)}: the shapes do not match the shards"
                    )
            if sub not in sub_of_group:
                raise InputError(f"sub-group {sub} belongs to no param group in the optimizer state")
        return sub_of_group

    @staticmethod
    def _why_missing(ds_config: Mapping[str, Any]) -> str:
        """Why a sub-group's optimizer state can be missing from a whole save: ZeRO-Offload++."""
        ratio = partial_offload_ratio(ds_config)
        if ratio is None:
            return ""
        return (
            f": saved with offload_optimizer.ratio={ratio:g} (ZeRO-Offload++), DeepSpeed 0.19.8 steps the first "
            "sub-groups of each rank on the GPU with a second optimizer and saves only its CPU optimizer's "
            "moments, so these files do not hold them; save with ratio 1 to move the run"
        )

    def _collect_keys(
        self,
        inners: list[tuple[list[Mapping[str, Any]], Mapping[Any, Any]]],
        flat: list[list[torch.Tensor]],
        subs: list[int],
        ds_config: Mapping[str, Any],
    ) -> None:
        """Optimizer state: every sub-group read on every rank, the same keys everywhere, or none at all."""
        head_state = inners[0][1]
        self._has_moments = bool(head_state)
        self._keys: dict[int, tuple[str, ...]] = {sub: () for sub in range(len(flat[0]))}
        self._scalars: dict[int, dict[str, torch.Tensor]] = {sub: {} for sub in range(len(flat[0]))}
        for rank, (tf, (_, rank_state)) in enumerate(zip(self._optim, inners)):
            if bool(rank_state) != self._has_moments:
                raise InputError(
                    f"{tf.path.name} {'has' if rank_state else 'lacks'} optimizer moments but "
                    f"{self._optim[0].path.name} {'has' if head_state else 'lacks'} them: ranks from different "
                    "saves are mixed"
                )
            if not self._has_moments:
                continue
            for sub in subs:
                entry = rank_state.get(sub)
                if entry is None:
                    raise InputError(
                        f"{tf.path.name} has no optimizer state for sub-group {sub}{self._why_missing(ds_config)}"
                    )
                entry = need_mapping(entry, f"{tf.path.name}: optimizer state of sub-group {sub}")
                self._keys[sub] = flat_state_keys(
                    entry,
                    flat[rank][sub].numel(),
                    f"{tf.path.name}: sub-group {sub}",
                    self._keys[sub] if rank else None,
                )
                where = f"{tf.path.name}: sub-group {sub}"
                self._scalars[sub] = rank_scalars(entry, self._scalars[sub] if rank else None, where, self._derived)

    def _sub_steps(
        self,
        groups_raw: list[Mapping[str, Any]],
        sub_of_group: dict[int, int],
        inners: list[tuple[list[Mapping[str, Any]], Mapping[Any, Any]]],
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

    def _pieces(self, where: _Where, key: str | None) -> Pieces:
        """One flat state of a parameter as its rank slices, each where it lies in its shard on disk."""
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
