"""DeepSpeed ZeRO-3 checkpoints -> per-parameter state, streamed one parameter at a time.

Each rank's optim file holds, per sub-group, a flat fp32 buffer and Adam moments of the same
layout: the rank's ``ceil(numel/dp)`` partition of each member parameter, concatenated
(``ucp.partition``). ``param_shapes`` in the model-states files names the members of each
sub-group in order; the optimizer's param groups list which sub-groups each group owns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ucp import flavors
from ucp.errors import InputError
from ucp.partition import zero3_partition_size, zero3_rank_span
from ucp.records import Facts, GroupMeta, ParamMeta, ParamState, SourceInfo, dtype_name
from ucp.sources.common import (client_state, engine_counters, model_dtype, optimizer_block, partition_count,
                                stage_of, tensor_shape)
from ucp.sources.files import CheckpointFiles
from ucp.torchfile import TorchFile

__all__ = ["Zero3Source"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Where:
    sub_group: int
    offset: int
    size: int
    numel: int
    shape: tuple[int, ...]


class Zero3Source:
    """A ZeRO-3 checkpoint as a :class:`ucp.records.Reader` (one mp rank)."""

    def __init__(self, files: CheckpointFiles, *, optimizer: str | None = None, mp_rank: int = 0) -> None:
        self.files = files
        self._optim = [TorchFile(p) for p in files.optim[mp_rank]]
        self._model = [TorchFile(p) for p in files.model[mp_rank]]
        try:
            self.facts = self._facts(optimizer)
        except Exception:
            self.close()
            raise

    # -- facts -------------------------------------------------------------------------------
    def _facts(self, optimizer: str | None) -> Facts:
        dp = len(self._optim)
        blocks = [optimizer_block(tf) for tf in self._optim]
        for tf, block in zip(self._optim, blocks):
            stage = stage_of(block)
            if stage != 3:
                raise InputError(f"{tf.path.name} says zero_stage={stage}, but its folder holds ZeRO-3 model files")
            count = partition_count(block)
            if count != dp:
                raise InputError(f"{tf.path.name} says partition_count={count}, but {dp} rank files were found")
        models = [tf.obj for tf in self._model]
        for tf in self._model:
            if not isinstance(tf.obj, Mapping) or "param_shapes" not in tf.obj:
                raise InputError(f"{tf.path.name} has no param_shapes: not a ZeRO-3 model-states file")
        versions = {str(m.get("ds_version")) for m in models}
        if len(versions) > 1:
            raise InputError(f"rank files were written by different DeepSpeed versions: {sorted(versions)}")
        head = models[0]
        shapes = head["param_shapes"]
        if any(m["param_shapes"] != shapes for m in models[1:]):
            raise InputError("model-states files disagree on param_shapes: ranks from different runs are mixed")
        ds_config = head.get("ds_config") or {}

        base = blocks[0]["optimizer_state_dict"]
        groups_raw = base.get("param_groups") or []
        state = base.get("state") or {}
        detection = flavors.detect(base, ds_config, optimizer)
        flat = [b.get("fp32_flat_groups") for b in blocks]
        if any(not isinstance(f, (list, tuple)) or len(f) != len(shapes) for f in flat):
            raise InputError(f"optim files hold fp32_flat_groups for a different number of sub-groups than the "
                             f"{len(shapes)} in param_shapes")

        # where every optimized parameter sits
        self._where: dict[str, _Where] = {}
        sub_of_group: dict[int, int] = {}
        for g, group in enumerate(groups_raw):
            for sub in group.get("params", []):
                sub_of_group[int(sub)] = g
        for sub, members in enumerate(shapes):
            offset = 0
            for name, shape in members.items():
                shape = tensor_shape(shape)
                numel = 1
                for d in shape:
                    numel *= d
                size = zero3_partition_size(numel, dp)
                self._where[name] = _Where(sub, offset, size, numel, shape)
                offset += size
            for rank, rank_flat in enumerate(flat):
                have = rank_flat[sub].numel()
                if have != offset:
                    raise InputError(f"sub-group {sub} on rank {rank} holds {have} elements, but its parameters' "
                                     f"partitions add up to {offset} at dp={dp}")
            if sub not in sub_of_group:
                raise InputError(f"sub-group {sub} belongs to no param group in the optimizer state")

        # steps, per sub-group, checked across ranks
        sub_steps: dict[int, int | None] = {}
        for sub in range(len(shapes)):
            group = groups_raw[sub_of_group[sub]]
            steps = set()
            for rank, block in enumerate(blocks):
                entry = (block["optimizer_state_dict"].get("state") or {}).get(sub, {})
                steps.add(detection.flavour.read_step(group, entry) if detection.flavour else None)
            if len(steps) > 1:
                detection.warnings.append(f"sub-group {sub} has different steps across ranks: {sorted(map(str, steps))}")
            sub_steps[sub] = max((s for s in steps if s is not None), default=None)
            for rank, block in enumerate(blocks):
                entry = (block["optimizer_state_dict"].get("state") or {}).get(sub)
                if entry is not None and "exp_avg" in entry and entry["exp_avg"].numel() != flat[rank][sub].numel():
                    raise InputError(f"rank {rank} sub-group {sub}: exp_avg holds {entry['exp_avg'].numel()} "
                                     f"elements, fp32 holds {flat[rank][sub].numel()}")
        self._has_moments = bool(state)

        dtype = model_dtype(head, shapes, files_bf16=self.files.bf16_prefix)
        params: list[ParamMeta] = []
        groups: list[GroupMeta] = []
        for g, group in enumerate(groups_raw):
            names: list[str] = []
            for sub in group.get("params", []):
                for name in shapes[int(sub)]:
                    names.append(name)
                    params.append(ParamMeta(name, self._where[name].shape, dtype, g, False))
            member_steps = [sub_steps[int(s)] for s in group.get("params", []) if sub_steps[int(s)] is not None]
            groups.append(GroupMeta(
                index=g,
                hyper=flavors.hyper_from_group(group, detection.adam_w_mode),
                raw={k: flavors._json_value(v) for k, v in group.items() if k != "params"},
                params=names,
                step=max(member_steps, default=None),
            ))
        self._steps = {name: sub_steps[w.sub_group] for name, w in self._where.items()}

        frozen_shapes = head.get("frozen_param_shapes") or {}
        self._frozen: dict[str, tuple[int, ...]] = {}
        for name, shape in frozen_shapes.items():
            shape = tensor_shape(shape)
            self._frozen[name] = shape
            fragment = (head.get("frozen_param_fragments") or {}).get(name)
            frozen_dtype = dtype_name(fragment.dtype) if torch.is_tensor(fragment) else dtype
            params.append(ParamMeta(name, shape, frozen_dtype, None, True))

        counters = engine_counters(head)
        info = SourceInfo(
            format="deepspeed",
            zero_stage=3,
            dp_world_size=dp,
            mp_world_size=int(head.get("mp_world_size") or 1),
            dtype=dtype,
            ds_version=versions.pop(),
            tag=self.files.tag,
            sub_group_size=_sub_group_size(ds_config),
            ds_config=_jsonable(ds_config),
            **counters,
        )
        steps = [s for s in self._steps.values() if s is not None]
        return Facts(
            info=info,
            flavour=detection.flavour.name if detection.flavour else None,
            adam_w_mode=detection.adam_w_mode,
            step=max(steps, default=None),
            groups=groups,
            params=params,
            tied=dict(head.get("shared_params") or {}),
            buffer_names=list(head.get("buffer_names") or []),
            warnings=detection.warnings,
        )

    # -- tensors -----------------------------------------------------------------------------
    def _assemble(self, where: _Where, pick: Any) -> torch.Tensor:
        dp = len(self._optim)
        out = torch.empty(where.numel, dtype=torch.float32)
        for rank, tf in enumerate(self._optim):
            start, end = zero3_rank_span(where.numel, dp, rank)
            if end <= start:
                continue
            flat = pick(tf.obj["optimizer_state_dict"])
            piece = flat.detach().narrow(0, where.offset, end - start)
            out[start:end].copy_(piece)
            tf.release(piece)
        return out.view(where.shape)

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        if name in self._frozen:
            return ParamState(fp32=self._frozen_tensor(name))
        where = self._where.get(name)
        if where is None:
            raise InputError(f"parameter {name!r} is not in this checkpoint")
        sub = where.sub_group
        fp32 = self._assemble(where, lambda block: block["fp32_flat_groups"][sub])
        if not moments or not self._has_moments:
            return ParamState(fp32=fp32, step=self._steps.get(name))
        exp_avg = self._assemble(where, lambda block: block["optimizer_state_dict"]["state"][sub]["exp_avg"])
        exp_avg_sq = self._assemble(where, lambda block: block["optimizer_state_dict"]["state"][sub]["exp_avg_sq"])
        return ParamState(fp32=fp32, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=self._steps.get(name))

    def _frozen_tensor(self, name: str) -> torch.Tensor:
        shape = self._frozen[name]
        numel = 1
        for d in shape:
            numel *= d
        dp = len(self._model)
        out = torch.empty(numel, dtype=torch.float32)
        for rank, tf in enumerate(self._model):
            start, end = zero3_rank_span(numel, dp, rank)
            if end <= start:
                continue
            fragment = (tf.obj.get("frozen_param_fragments") or {}).get(name)
            if fragment is None:
                raise InputError(f"{tf.path.name} has no fragment of frozen parameter {name!r}")
            if fragment.numel() < end - start:
                raise InputError(f"{tf.path.name}: fragment of {name!r} holds {fragment.numel()} elements, "
                                 f"needs {end - start}")
            out[start:end].copy_(fragment.detach().reshape(-1)[: end - start])
        return out.view(shape)

    def buffers(self) -> dict[str, torch.Tensor]:
        head = self._model[0].obj
        module = head.get("module") or {}
        return {name: module[name].detach().clone() for name in head.get("buffer_names") or [] if name in module}

    def extras(self) -> dict[str, Any]:
        head = self._model[0].obj
        block = optimizer_block(self._optim[0])
        return {
            "lr_scheduler": head.get("lr_scheduler"),
            "data_sampler": head.get("data_sampler"),
            "random_ltd": head.get("random_ltd"),
            "client_state": client_state(head),
            "loss_scaler": block.get("loss_scaler"),
            "dynamic_loss_scale": block.get("dynamic_loss_scale"),
            "overflow": block.get("overflow"),
        }

    def close(self) -> None:
        for tf in getattr(self, "_optim", []) + getattr(self, "_model", []):
            tf.close()


def _sub_group_size(ds_config: Mapping[str, Any]) -> int | None:
    zero = ds_config.get("zero_optimization") if isinstance(ds_config, Mapping) else None
    if isinstance(zero, Mapping) and zero.get("sub_group_size") is not None:
        return int(zero["sub_group_size"])
    return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return repr(value)
