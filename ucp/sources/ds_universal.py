"""DeepSpeed's own universal checkpoints (``ds_to_universal`` output) -> per-parameter state.

What ``python -m deepspeed.checkpoint.ds_to_universal`` writes (read off DeepSpeed 0.19.8)::

    ROOT/latest_universal                    names the folder below
    ROOT/<tag>_universal/zero/<name>/fp32.pt, exp_avg.pt, exp_avg_sq.pt
        ZeRO-3: the flat, unpadded tensor itself; ZeRO-1/2: {"param": tensor in its shape, "cat_dim": 0}
    ROOT/<tag>_universal/zero/<name>/step.pt  ZeRO-1/2 only: the param group's raw step
    ROOT/<tag>_universal/zero/optimizer_state.pt
        ZeRO-3: rank 0's whole ZeRO optimizer dict (its own shards and per-sub-group steps too) plus
        ``param_groups``; ZeRO-1/2: rank 0's dict without the shards, plus the param groups
    ROOT/<tag>_universal/*model_states.pt     copied unchanged from the source tag folder

Group membership and shapes come from the copied model states' ``param_shapes`` (ZeRO-3: per
sub-group, mapped to groups by ``param_groups[g]["params"]``; ZeRO-1/2: one entry per group).
ZeRO-3 writes no folder for frozen parameters: they are rebuilt from every rank's
``frozen_param_fragments``. ZeRO-1/2 writes an fp32.pt for everything in ``module`` (frozen
parameters, tied aliases and buffers too, cast to fp32); ucp takes those from ``module`` instead.

An AutoEP run (the model states list ``ds_autoep_layers``): each fused expert tensor ``{module}.experts.w1``
gets one folder holding the whole ``[experts, ...]`` tensor (its files add ``is_expert_param`` and
``ep_num_experts``), while ``param_shapes`` keeps rank 0's local ``[experts / ep, ...]``. ucp reads it as
:class:`~ucp.sources.autoep.AutoEpSource` reads the original checkpoint: one parameter per expert,
``{module}.experts.w1.{e}``, and the same ``autoep`` layout in its facts.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed.autoep import AUTOEP_LAYERS, WEIGHTS, AutoEpLayer, autoep_layers, autoep_record, expert_name
from ucp.deepspeed.fields import (
    build_facts,
    jsonable,
    need_mapping,
    sub_group_size,
    tensor_shape,
)
from ucp.deepspeed.model_states import (
    engine_counters,
    model_dtype,
    model_extras,
    module_buffers,
    module_ties,
    zero12_frozen_values,
)
from ucp.deepspeed.optim_states import read_universal_optimizer_state
from ucp.errors import InputError, StepConflictError
from ucp.io import torchfile
from ucp.io.torchfile import TorchFile
from ucp.model.detect import Detection
from ucp.model.layouts import SourceLayout
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, Reader, SourceInfo, dtype_name
from ucp.sources.common import group_meta, zero3_gather
from ucp.sources.ds_universal_groups import (
    check_groups,
    refuse_round_robin,
    refuse_whole_state,
    zero3_groups,
    zero12_groups,
)
from ucp.sources.ds_universal_models import open_models, zero3_frozen
from ucp.sources.format import How, Probe, SourceFormat

__all__ = ["FORMAT", "DsUniversalSource"]

logger = logging.getLogger(__name__)

_FP32 = "fp32.pt"
_STEP = "step.pt"


class DsUniversalSource(Reader):
    """A ds_to_universal output folder as a :class:`ucp.model.records.Reader` (no tensor parallelism).

    Call order: construct (reads optimizer_state.pt's small fields and the model states, checks
    every parameter's files exist; no parameter tensor is read), then ``read`` per parameter from
    any thread (each call loads only that parameter's files), ``buffers``/``extras``, ``close``.
    """

    def __init__(self, root: str | Path, *, optimizer: str | None = None) -> None:
        self.root = Path(root)
        self._zero = self.root / "zero"
        self._models: dict[int, TorchFile] = {}
        self._step_files = False  # ZeRO-1/2 with the step in the optimizer state: zero/<name>/step.pt
        self._fused: dict[str, tuple[AutoEpLayer, str]] = {}  # AutoEP fused tensor -> (its layer, weight)
        self._expert_of: dict[str, tuple[str, int]] = {}  # expert parameter -> (fused tensor's folder, expert)
        #: the AutoEP layers as :class:`~ucp.sources.autoep.AutoEpSource` records them; None without AutoEP
        self.autoep: dict[str, Any] | None = None
        self.facts = build_facts(
            lambda: self._facts(optimizer),
            close=self.close,
            where=f"{self.root}: not a ds_to_universal folder ucp can read",
        )

    # -- facts -------------------------------------------------------------------------------
    def _require(self, pname: str, leaf: str, keys: tuple[str, ...] = ()) -> Path:
        path = self._zero / pname / leaf
        if not path.is_file():
            files = [_FP32] + [k + ".pt" for k in keys] + ([_STEP] if self._step_files else [])
            needs = ", ".join(files[:-1]) + f" and {files[-1]}" if len(files) > 1 else files[0]
            raise InputError(
                f"zero/{pname}/{leaf} is missing from {self.root}: every optimized parameter needs "
                f"{needs}; the folder is incomplete, so rerun ds_to_universal"
            )
        return path

    def _state_keys(self, pname: str) -> tuple[str, ...]:
        """The optimizer state ds_to_universal wrote for a parameter: one file per key beside fp32.pt."""
        try:
            leaves = [p.name for p in (self._zero / pname).iterdir() if p.name.endswith(".pt")]
        except OSError as err:
            raise InputError(f"cannot list zero/{pname} in {self.root}: {err.strerror}") from None
        return tuple(sorted(leaf[:-3] for leaf in leaves if leaf not in (_FP32, _STEP)))

    def _facts(self, optimizer: str | None) -> Facts:
        optim = read_universal_optimizer_state(self.root)
        stage, dp = optim["zero_stage"], optim["partition_count"]
        self._zero3 = stage == 3
        head = open_models(self.root, stage, dp, self._models)
        self._read_autoep(head, dp, stage)
        shapes = [need_mapping(s, "param_shapes entry") for s in head["param_shapes"]]
        ds_config = head.get("ds_config") or {}
        groups_raw = optim["param_groups"]
        check_groups(groups_raw)
        layout = [[int(s) for s in g.get("params", [])] for g in groups_raw]
        if stage == 3:
            members, detection, sub_steps = zero3_groups(optim, shapes, layout, ds_config, optimizer, dp)
        else:
            members, detection, sub_steps = zero12_groups(self._zero, shapes, groups_raw, layout, ds_config, optimizer)
            refuse_whole_state(detection, groups_raw, ds_config, stage)
            refuse_round_robin(shapes, ds_config, dp, stage)

        dtype = model_dtype(head, shapes, files_bf16=False)
        params, groups = self._optimized(groups_raw, members, shapes, sub_steps, detection, dtype)
        tied = module_ties(head, self._shape)
        buffer_names = list(head.get("buffer_names") or [])
        warnings = list(detection.warnings)
        self._frozen: dict[str, tuple[int, ...]] = {}
        self._frozen_values: dict[str, torch.Tensor] = {}
        if stage == 3:
            frozen = zero3_frozen(self.root, self._models, head, dp, warnings)
        else:
            frozen = self._zero12_frozen(head, tied, buffer_names)
        for pname, (shape, frozen_dtype) in frozen.items():
            if pname in self._shape:
                raise InputError(f"parameter {pname!r} is listed both as optimized and as frozen")
            self._frozen[pname] = shape
            params.append(ParamMeta(pname, shape, frozen_dtype or dtype, None, True))

        self._extras = {k: optim[k] for k in ("loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad")}
        info = self._info(head, optim, ds_config, dtype)
        steps = [s for s in self._steps.values() if s is not None]
        return Facts(
            info=info,
            flavour=detection.flavour.name if detection.flavour else None,
            adam_w_mode=detection.adam_w_mode,
            step=max(steps, default=None),
            groups=groups,
            params=params,
            tied=tied,
            buffer_names=buffer_names,
            warnings=warnings,
            layout=SourceLayout("autoep", self.autoep) if self.autoep else None,
        )

    def _read_autoep(self, head: Mapping[str, Any], dp: int, stage: int) -> None:
        """The AutoEP layers of the copied model states: which folders hold fused experts, and the record
        :func:`ucp.targets.autoep.write_autoep` reads back."""
        if head.get(AUTOEP_LAYERS) is not None and stage == 3:
            raise InputError(
                f"{self.root} is ds_to_universal's output of a ZeRO-3 AutoEP checkpoint, which ucp does not read: "
                "convert the original checkpoint with `ucp to-universal CKPT OUT` instead"
            )
        layers = autoep_layers(head, self._models[0].path.name)
        if layers is None:
            return
        self._fused = {x.fused(w): (x, w) for x in layers for w in WEIGHTS}
        self.autoep = autoep_record(layers, dp)

    def _members(self, pname: str, dtype: str, g: int) -> list[ParamMeta]:
        """The parameters one folder holds: itself, or each expert of an AutoEP fused tensor under its global
        name (ds_to_universal writes the whole ``[experts, ...]`` tensor; ``param_shapes`` lists rank 0's part)."""
        fused = self._fused.get(pname)
        if fused is None:
            return [ParamMeta(pname, self._shape[pname], dtype, g, False)]
        layer, weight = fused
        whole = layer.shapes[weight]
        if self._shape[pname] != (layer.local, *whole[1:]):
            raise InputError(
                f"{pname} has shape {list(self._shape[pname])} in param_shapes, but ds_autoep_layers gives rank 0 "
                f"[{layer.local}, {', '.join(map(str, whole[1:]))}]: files of different checkpoints are mixed"
            )
        self._shape[pname] = whole
        out = []
        for e in range(layer.experts):
            name = expert_name(layer.prefix, weight, e)
            self._expert_of[name] = (pname, e)
            out.append(ParamMeta(name, whole[1:], dtype, g, False))
        return out

    def _optimized(
        self,
        groups_raw: list[dict[str, Any]],
        members: list[list[int]],
        shapes: list[Mapping[str, Any]],
        sub_steps: Mapping[int, int | None],
        detection: Detection,
        dtype: str,
    ) -> tuple[list[ParamMeta], list[GroupMeta]]:
        """The optimized parameters by group, each one's files checked present (every key of its group)."""
        self._flavour = detection.flavour
        self._step_files = not self._zero3 and detection.flavour is not None and detection.flavour.step_in_state
        leaves = (_FP32,) + ((_STEP,) if self._step_files else ())
        self._shape: dict[str, tuple[int, ...]] = {}
        self._steps: dict[str, int | None] = {}
        self._group_of: dict[str, int] = {}
        self._keys: dict[str, tuple[str, ...]] = {}
        params: list[ParamMeta] = []
        groups: list[GroupMeta] = []
        for g, group in enumerate(groups_raw):
            folders: list[str] = []
            names: list[str] = []
            for sub in members[g]:
                for pname, shape in shapes[sub].items():
                    if pname in self._shape:
                        raise InputError(f"parameter {pname!r} appears twice in param_shapes")
                    if pname.startswith(("/", "\\")) or ".." in re.split(r"[/\\]", pname):
                        # ds_to_universal joins the name onto zero/ as it is; never follow one out of it
                        raise InputError(
                            f"parameter name {pname!r:.60} in param_shapes leads outside {self._zero}: "
                            "the model states are damaged or hand-made"
                        )
                    self._shape[pname] = tensor_shape(shape)
                    self._steps[pname] = sub_steps[sub]
                    self._group_of[pname] = g
                    for leaf in leaves:
                        self._require(pname, leaf)
                    folders.append(pname)
                    members_of = self._members(pname, dtype, g)
                    names += [m.name for m in members_of]
                    params += members_of
            member_steps = [s for s in (sub_steps[m] for m in members[g]) if s is not None]
            keys = tuple(sorted({k for n in folders for k in self._state_keys(n)}))
            for pname in folders:  # every member holds every key of its group
                for key in keys:
                    self._require(pname, key + ".pt", keys)
                self._keys[pname] = keys
            groups.append(group_meta(g, group, names, max(member_steps, default=None), detection.adam_w_mode, keys))
        self._groups_raw = groups_raw
        # ds_to_universal writes every key for every optimized parameter: a key one lacks is a missing file
        every = tuple(sorted({k for keys in self._keys.values() for k in keys}))
        for pname in self._keys:
            for key in every:
                self._require(pname, key + ".pt", every)

        return params, groups

    def _info(
        self, head: Mapping[str, Any], optim: Mapping[str, Any], ds_config: Mapping[str, Any], dtype: str
    ) -> SourceInfo:
        stage, dp = optim["zero_stage"], optim["partition_count"]
        return SourceInfo(
            format="ds-universal",
            zero_stage=stage,
            dp_world_size=dp,
            mp_world_size=1,
            dtype=dtype,
            ds_version=str(head.get("ds_version") or optim.get("ds_version")),
            tag=self.root.name,
            sub_group_size=sub_group_size(ds_config) if stage == 3 else None,
            ds_config=jsonable(ds_config),
            **engine_counters(head),
        )

    def _zero12_frozen(
        self, head: Mapping[str, Any], tied: Mapping[str, str], buffer_names: list[str]
    ) -> dict[str, tuple[tuple[int, ...], str | None]]:
        """Stage 2 lists frozen parameters (frozen_param_*); stage 1 leaves them in ``module`` only."""
        values = zero12_frozen_values(head, self._shape, tied, buffer_names, self._models[0].path.name)
        self._frozen_values.update(values)
        return {k: (tuple(v.shape), dtype_name(v.dtype)) for k, v in values.items()}

    # -- tensors -----------------------------------------------------------------------------
    def _tensor(self, pname: str, leaf: str, expert: int | None = None) -> torch.Tensor:
        """One state file: ZeRO-3 writes the flat tensor, ZeRO-1/2 ``{"param": shaped tensor, ...}``;
        of an AutoEP fused tensor only ``expert``'s slice is copied out of the mapped file."""
        path = self._require(pname, leaf)
        with TorchFile(path) as tf:
            obj = tf.obj
            tensor = obj.get("param") if isinstance(obj, Mapping) else obj
            where = f"zero/{pname}/{leaf}"
            if not torch.is_tensor(tensor):
                raise InputError(f"{where} holds no tensor (neither the tensor itself nor one under 'param')")
            shape = self._shape[pname]
            if tensor.dtype != torch.float32 or tensor.numel() != _numel(shape):
                raise InputError(
                    f"{where} holds a {str(tensor.dtype).replace('torch.', '')} tensor of "
                    f"{tensor.numel()} elements; {pname!r} has shape {shape}, so float32 with {_numel(shape)} "
                    "elements was expected: files of different checkpoints are mixed"
                )
            tensor = tensor.reshape(shape)
            return (tensor if expert is None else tensor[expert]).clone()

    def _step(self, pname: str) -> int | None:
        """The step of one parameter; ZeRO-1/2's per-parameter step.pt must agree with its group."""
        step = self._steps[pname]
        if not self._step_files or self._flavour is None:
            return step
        group = self._groups_raw[self._group_of[pname]]
        own = self._flavour.read_step(group, {"step": torchfile.load(self._require(pname, _STEP))})
        if own != step:
            raise StepConflictError(
                f"zero/{pname}/step.pt says step {own}, but param group "
                f"{self._group_of[pname]} is at step {step}; they share one flat optimizer "
                "tensor, so the folder mixes checkpoints"
            )
        return own

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        if name in self._frozen:
            return ParamState(fp32=self._frozen_tensor(name))
        folder, expert = self._expert_of.get(name, (name, None))
        if folder not in self._shape:
            raise InputError(f"parameter {name!r} is not in {self.root}")
        fp32 = self._tensor(folder, _FP32, expert)
        step = self._step(folder)
        if not moments:
            return ParamState(fp32=fp32, step=step)
        optim = {k: self._tensor(folder, k + ".pt", expert) for k in self._keys[folder]}
        return ParamState(fp32=fp32, optim=optim, step=step)

    def _frozen_tensor(self, name: str) -> torch.Tensor:
        shape = self._frozen[name]
        if name in self._frozen_values:  # ZeRO-1/2: whole in module
            return self._frozen_values[name].detach().reshape(shape).to(torch.float32, copy=True)
        return zero3_gather(
            lambda rank: self._models[rank].obj["frozen_param_fragments"][name],
            _numel(shape),
            shape,
            self.facts.info.dp_world_size,
        )

    def buffers(self) -> dict[str, torch.Tensor]:
        return module_buffers(self._models[0].obj, self._models[0].path.name)

    def extras(self) -> dict[str, Any]:
        return {**model_extras(self._models[0].obj, None), **self._extras}

    def close(self) -> None:
        for tf in getattr(self, "_models", {}).values():
            tf.close()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _open_ds_universal(probe: Probe, how: How) -> Reader:
    assert probe.ds_universal is not None  # claimed
    return DsUniversalSource(probe.ds_universal, optimizer=how.optimizer)


FORMAT = SourceFormat(
    name="ds-universal",
    label="DeepSpeed ds_to_universal folder",
    docs="format.md#deepspeeds-own-ds_to_universal-output",
    claims=lambda probe: probe.ds_universal is not None,
    open=_open_ds_universal,
    refines=("deepspeed",),  # it carries DeepSpeed's model-states files too
)
