"""DeepSpeed checkpoints saved without ZeRO (stage 0, DeepSpeed's default) -> per-parameter state.

DeepSpeed 0.19.8 writes one file per tag at stage 0, ``mp_rank_00_model_states.pt``: ``module`` (the whole
model in the training dtype), ``buffer_names``, the counters, ``lr_scheduler``, ``ds_config`` and ``optimizer``.
``param_shapes``, ``frozen_param_shapes`` and ``shared_params`` are there but None (the engine fills them only
under ZeRO). ``optimizer`` is, in fp32, the client torch optimizer's own ``state_dict()`` (state by param
index in param-group order; the module weights are the fp32 masters) and, in bf16/fp16,
``FP16_UnfusedOptimizer.state_dict()``: ``optimizer_state_dict`` (the inner torch optimizer's), ``fp32_groups``
(the fp32 masters of the trainable parameters, per group, in group order) and its loss-scale fields.

Nothing in the file names the parameter behind an optimizer index. Each group's members are found among the
module's parameters in model order (as every param-group recipe builds them, and as DeepSpeed's own load
assumes), by shape and, when there are fp32 masters, by value (the master rounded to the model dtype is the
module's weight, bit for bit). Where more than one assignment fits (an fp32 frozen parameter shaped like a
trained one), the checkpoint is refused in one line unless the frozen parameters are named.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from ucp.deepspeed.fields import (
    as_int,
    build_facts,
    check_name,
    jsonable,
    need_list,
    need_mapping,
    need_tensor,
)
from ucp.deepspeed.layout import CheckpointFiles
from ucp.deepspeed.model_states import (
    check_model_states,
    engine_counters,
    model_extras,
    module_buffers,
    module_ties,
    zero12_frozen_values,
)
from ucp.deepspeed.optim_states import FUSED_MASTERS, STEP_KEY, UNFUSED_INNER, UNFUSED_MASTERS, flat_state_scalars
from ucp.deepspeed.states import scaler_object
from ucp.errors import InputError
from ucp.io.torchfile import TorchFile
from ucp.model.detect import detect
from ucp.model.loss_scale import scale_from_wrapper
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, Reader, SourceInfo, dtype_name
from ucp.sources.common import group_meta
from ucp.sources.format import How, Probe, SourceFormat

__all__ = ["FORMAT", "Zero0Source"]

logger = logging.getLogger(__name__)

_INNER, _MASTERS, _FLAT_MASTERS = UNFUSED_INNER, UNFUSED_MASTERS, FUSED_MASTERS
#: the loss-scale fields DeepSpeed's FP16 wrappers save (the last three with a dynamic scale only)
_WRAPPER_SCALE = ("cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window")


class Zero0Source(Reader):
    """A stage-0 (no ZeRO) DeepSpeed checkpoint as a :class:`~ucp.model.records.Reader`.

    Call order: construct (reads the one model-states file's object tree, places every optimizer index
    on a parameter name and checks the state; tensors stay on the mmap), then ``read`` per parameter from
    any thread, ``buffers``/``extras``, ``close``. ``frozen`` names parameters that are not trained, for a
    checkpoint where the optimizer's shapes alone cannot tell them from trained ones. ``mp_rank``: the
    tensor-parallel rank whose file is read (its shards; ``open_reader`` merges the ranks).
    """

    def __init__(
        self,
        files: CheckpointFiles,
        *,
        optimizer: str | None = None,
        frozen: Collection[str] = (),
        mp_rank: int | None = None,
    ) -> None:
        self.files = files
        self._model: TorchFile | None = None

        def build() -> Facts:
            if mp_rank is None and files.mp > 1:
                raise InputError(
                    f"{files.tag_dir} holds {files.mp} mp_rank_XX_model_states.pt files without ZeRO: read each "
                    "tensor-parallel rank on its own (mp_rank=) and merge them (open_reader does)"
                )
            self._model = TorchFile(files.model[mp_rank or 0][0])
            return self._facts(optimizer, frozen)

        self.facts = build_facts(
            build, close=self.close, where=f"{files.tag_dir}: not a stage-0 DeepSpeed checkpoint ucp can read"
        )

    # -- facts -------------------------------------------------------------------------------
    def _name(self) -> str:
        return self._model.path.name if self._model is not None else "model states"

    def _head(self) -> Mapping[str, Any]:
        assert self._model is not None
        name = self._name()
        head = check_model_states(self._model.obj, name, "not a DeepSpeed model-states file", shapes=False)
        if head.get("param_shapes") is not None:
            raise InputError(
                f"{name} lists param_shapes, which only a ZeRO save writes, but {self.files.tag_dir} holds no "
                "*_optim_states.pt files: the optim files are missing; copy the whole tag folder"
            )
        zero = (head.get("ds_config") or {}).get("zero_optimization") or {}
        stage = as_int(zero.get("stage", 0), "ds_config zero_optimization.stage") if isinstance(zero, Mapping) else 0
        if stage != 0:
            raise InputError(
                f"{name}: ds_config says zero stage {stage}, but {self.files.tag_dir} holds no "
                "*_optim_states.pt files: the optim files are missing; copy the whole tag folder"
            )
        if not isinstance(head.get("module"), Mapping):
            raise InputError(f"{name} holds no module state dict: not a stage-0 model-states file")
        if head.get("optimizer") is None:
            raise InputError(
                f"{name} holds no optimizer state (saved without an optimizer): nothing to convert but the "
                "weights; export them with torch instead"
            )
        return head

    def _unwrap(
        self,
        opt: Mapping[str, Any],
        candidates: list[tuple[str, torch.Tensor]],
        head_config: Mapping[str, Any],
    ) -> tuple[Mapping[str, Any], list[list[torch.Tensor]] | None]:
        """The torch optimizer's state_dict and, under DeepSpeed's FP16 wrappers, its fp32 masters per group
        (the fused one's flat groups cut per parameter, see :func:`_unflatten`); the wrapper's loss scale (as the
        scaler a ZeRO run keeps, its minimum and hysteresis from ``head_config``, the run's DeepSpeed config) and
        gradient clipping are kept for ``extras``."""
        name = self._name()
        self._zero: dict[str, Any] | None = None
        fused = _FLAT_MASTERS in opt
        if not fused and _MASTERS not in opt:
            if not {"state", "param_groups"} <= set(opt):
                raise InputError(
                    f"{name}: optimizer holds {sorted(map(str, opt))[:6]}, neither a torch optimizer's state_dict "
                    "nor one of DeepSpeed's FP16 optimizer wrappers': the file is damaged or not from DeepSpeed"
                )
            return opt, None
        dynamic = opt.get("dynamic_loss_scale", False)  # the fused wrapper saves no scale when it does not scale
        if not isinstance(dynamic, bool):
            raise InputError(f"{name}: optimizer dynamic_loss_scale is {dynamic!r:.40}, not a flag: file damaged")
        numbers = {"cur_scale": 1.0, "cur_iter": 0} | {k: opt[k] for k in _WRAPPER_SCALE if k in opt}
        for key in ("cur_scale", "cur_iter", *(_WRAPPER_SCALE[2:] if dynamic else ())):
            value = numbers.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise InputError(f"{name}: optimizer {key} is {value!r:.40}, not a number: file damaged")
        # the wrapper keeps no minimum or hysteresis: those come from the run's fp16 config, the hysteresis whole
        scale = scale_from_wrapper({"dynamic_loss_scale": dynamic, **numbers}, head_config)
        if scale.problem() is not None:
            raise InputError(f"{name}: the optimizer's loss scale is damaged: {scale.problem()}")
        self._zero = {"loss_scaler": scaler_object(scale), "dynamic_loss_scale": dynamic}
        clip = opt.get("clip_grad")
        if isinstance(clip, (int, float)) and not isinstance(clip, bool):
            self._zero["clip_grad"] = float(clip)
        inner = need_mapping(opt.get(_INNER), f"{name}: optimizer {_INNER}")
        if fused:
            flats = [
                need_tensor(t, f"{name}: optimizer {_FLAT_MASTERS}[{g}]")
                for g, t in enumerate(need_list(opt[_FLAT_MASTERS], f"{name}: optimizer {_FLAT_MASTERS}"))
            ]
            return _unflatten(inner, flats, candidates, name)
        masters = [
            [need_tensor(t, f"{name}: optimizer {_MASTERS}[{g}]") for t in need_list(group, f"{name}: {_MASTERS}[{g}]")]
            for g, group in enumerate(need_list(opt[_MASTERS], f"{name}: optimizer {_MASTERS}"))
        ]
        return inner, masters

    def _members(self, inner: Mapping[str, Any]) -> tuple[list[Mapping[str, Any]], list[list[int]], Mapping[int, Any]]:
        """Param groups, each group's optimizer indices, and the state by index: every index in one group
        only, and state for every index or for none."""
        name = self._name()
        groups = [
            need_mapping(g, f"{name}: a param group")
            for g in need_list(inner.get("param_groups") or [], f"{name}: optimizer param_groups")
        ]
        members = [
            [
                as_int(p, f"{name}: param group {g} params entry")
                for p in need_list(group.get("params"), f"{name}: param group {g} params")
            ]
            for g, group in enumerate(groups)
        ]
        listed = [i for m in members for i in m]
        if len(set(listed)) != len(listed):
            raise InputError(f"{name}: the optimizer's param groups list an index twice: the file is damaged")
        raw_state = need_mapping(inner.get("state") or {}, f"{name}: optimizer state")
        state = {as_int(k, f"{name}: optimizer state index"): v for k, v in raw_state.items()}
        stray = sorted(set(state) - set(listed))
        if stray:
            raise InputError(
                f"{name}: the optimizer holds state for {len(state)} parameters, its param groups list {len(listed)}: "
                f"index {stray[0]} is in no group; the file is damaged"
            )
        missing = sorted(set(listed) - set(state))
        if state and missing:
            raise InputError(
                f"{name}: the optimizer holds state for {len(state)} of the {len(listed)} parameters its param groups "
                f"list (index {missing[0]} has none: a parameter that never got a gradient?); ucp cannot place it"
            )
        return groups, members, state

    def _entry_keys(self, entry: Any, where: str) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
        """A parameter's elementwise state keys (every key but the step and 0-dim scalars) and their shape."""
        entry = need_mapping(entry, where)
        keys = tuple(k for k in entry if k != STEP_KEY and k not in flat_state_scalars(entry))
        shapes = set()
        for key in keys:
            value = entry[key]
            if not torch.is_tensor(value) or not value.is_floating_point() or value.layout != torch.strided:
                raise InputError(
                    f"{where}: optimizer state {key!r} is a {type(value).__name__}, not a floating tensor shaped like "
                    "its parameter: ucp refuses the checkpoint rather than drop it"
                )
            shapes.add(tuple(value.shape))
        if len(shapes) > 1:
            raise InputError(f"{where}: optimizer state tensors have different shapes {sorted(shapes)}: file damaged")
        return keys, (shapes.pop() if shapes else None)

    def _facts(self, optimizer: str | None, frozen: Collection[str]) -> Facts:
        name = self._name()
        head = self._head()
        ds_config = head.get("ds_config") or {}
        module = head["module"]
        buffer_names = [str(n) for n in need_list(head.get("buffer_names") or [], f"{name}: buffer_names")]
        dtype = _config_dtype(ds_config)
        for n in frozen:
            check_name(n, "the frozen names given")
        candidates = _candidates(module, buffer_names)
        unknown = sorted(set(frozen) - set(candidates))
        if unknown:
            raise InputError(f"{name}: the frozen names given list {unknown[:3]}, which its module does not hold")
        trainable = [(n, t) for n, t in candidates.items() if n not in set(frozen)]
        opt = need_mapping(head["optimizer"], f"{name}: optimizer")
        inner, masters = self._unwrap(opt, trainable, ds_config)
        groups_raw, members, state = self._members(inner)
        if masters is not None and [len(m) for m in masters] != [len(m) for m in members]:
            raise InputError(
                f"{name}: {_MASTERS} holds {[len(m) for m in masters]} fp32 masters per group, the optimizer's "
                f"param groups {[len(m) for m in members]} parameters: the file is damaged"
            )
        detection = detect(inner, ds_config, optimizer or self.files.reset_flavour)
        flavour = detection.flavour
        # per group: its members' state keys (they must agree) and each member's shape, step and master
        self._keys: list[tuple[str, ...]] = []
        self._state: dict[str, Mapping[str, Any]] = {}
        self._steps: dict[str, int | None] = {}
        self._masters: dict[str, torch.Tensor] = {}
        self._group: dict[str, int] = {}
        want: list[list[tuple[tuple[int, ...] | None, torch.Tensor | None]]] = []
        for g, indices in enumerate(members):
            keys: tuple[str, ...] | None = None
            row = []
            for j, index in enumerate(indices):
                where = f"{name}: optimizer state of param group {g} entry {j} (index {index})"
                entry_keys, shape = self._entry_keys(state.get(index, {}), where)
                if keys is not None and entry_keys != keys:
                    raise InputError(f"{where} holds {list(entry_keys)}, entry 0 holds {list(keys)}: file damaged")
                keys = entry_keys
                master = masters[g][j] if masters is not None else None
                if master is not None:
                    if master.dtype != torch.float32:
                        raise InputError(f"{name}: {_MASTERS}[{g}][{j}] is {master.dtype}, not an fp32 master")
                    if shape is not None and shape != tuple(master.shape):
                        raise InputError(f"{where}: state shaped {shape}, its fp32 master {tuple(master.shape)}")
                    shape = tuple(master.shape)
                row.append((shape, master))
            self._keys.append(keys or ())
            want.append(row)
        placed = _place(want, trainable, masters is not None, name)
        params: list[ParamMeta] = []
        groups: list[GroupMeta] = []
        group_steps: list[int | None] = []
        for g, indices in enumerate(members):
            names = placed[g]
            seen: set[int | None] = set()
            for j, (pname, index) in enumerate(zip(names, indices)):
                shape = want[g][j][0]
                value = need_tensor(module[pname], f"{name}: module entry {pname!r}")
                if shape is not None and tuple(value.shape) != shape:  # _place matched shapes; kept as a guard
                    raise InputError(f"{name}: {pname!r} is shaped {tuple(value.shape)}, its state {shape}")
                entry = state.get(index, {})
                step = flavour.read_step(groups_raw[g], entry) if flavour is not None else None
                if step is None and self._keys[g] and flavour is not None and flavour.group_has_step(groups_raw[g]):
                    where = "per parameter" if flavour.step_in_state else "in its param group"
                    raise InputError(
                        f"{name}: the optimizer state of {pname!r} holds {list(self._keys[g])} but no step, which "
                        f"{flavour.name} keeps {where}: the file is damaged"
                    )
                seen.add(step)
                self._steps[pname] = step
                self._group[pname] = g
                self._state[pname] = entry
                master = want[g][j][1]
                self._masters[pname] = master if master is not None else value
                params.append(ParamMeta(pname, tuple(value.shape), dtype_name(value.dtype), g, False))
            if len(seen) > 1:
                detection.warnings.append(
                    f"param group {g}'s parameters took different numbers of steps: {sorted(map(str, seen))}"
                )
            step = max((s for s in seen if s is not None), default=None)
            group_steps.append(step)
            groups.append(group_meta(g, groups_raw[g], names, step, detection.adam_w_mode, self._keys[g]))
        tied = module_ties(head, self._masters)
        self._frozen: dict[str, torch.Tensor] = {}
        for pname, value in zero12_frozen_values(head, self._masters, tied, buffer_names, name).items():
            self._frozen[pname] = value
            params.append(ParamMeta(pname, tuple(value.shape), dtype_name(value.dtype), None, True))
        derived = flavour.derived if flavour else ()
        self._scalars = {p: flat_state_scalars(e, derived) for p, e in self._state.items()}
        warnings = list(detection.warnings)
        if masters is not None and any(s is not None for s in group_steps):
            warnings.append(
                "DeepSpeed's FP16 optimizer wrapper stepped the optimizer once with zero gradients when it was built, "
                "so its step is global_steps + 1; the step is carried as the optimizer holds it"
            )
        if masters is None:
            warnings.append(
                "a stage-0 fp32 checkpoint names no parameters: its optimizer entries were placed on the module's "
                "parameters in model order by shape, as a resume of the same script assumes (param groups that "
                "list parameters of one shape out of model order cannot be told apart)"
            )
        info = SourceInfo(
            format="deepspeed",
            zero_stage=0,
            dp_world_size=as_int(head.get("dp_world_size") or 1, "dp_world_size"),
            mp_world_size=as_int(head.get("mp_world_size") or 1, "mp_world_size"),
            dtype=dtype,
            ds_version=str(head.get("ds_version")),
            tag=self.files.tag,
            sub_group_size=None,
            ds_config=jsonable(ds_config),
            **engine_counters(head),
        )
        return Facts(
            info=info,
            flavour=flavour.name if flavour else None,
            adam_w_mode=detection.adam_w_mode,
            step=max((s for s in group_steps if s is not None), default=None),
            groups=groups,
            params=params,
            tied=tied,
            buffer_names=buffer_names,
            warnings=warnings,
        )

    # -- tensors -----------------------------------------------------------------------------
    def read(self, name: str, *, moments: bool = True) -> ParamState:
        if name in self._frozen:
            return ParamState(fp32=self._frozen[name].detach().to(torch.float32, copy=True))
        if name not in self._masters:
            raise InputError(f"parameter {name!r} is not in this checkpoint")
        fp32 = self._masters[name].detach().to(torch.float32, copy=True)
        step = self._steps[name]
        if not moments:
            return ParamState(fp32=fp32, step=step)
        g = self._group[name]
        entry = self._state[name]
        optim = {key: entry[key].detach().to(torch.float32, copy=True) for key in self._keys[g] if key in entry}
        scalars = {k: v.clone() for k, v in self._scalars[name].items()}
        return ParamState(fp32=fp32, optim=optim, step=step, scalars=scalars)

    def param_steps(self) -> dict[str, int | None]:
        return {p.name: (None if p.frozen else self._steps.get(p.name)) for p in self.facts.params}

    def buffers(self) -> dict[str, torch.Tensor]:
        assert self._model is not None
        return module_buffers(self._model.obj, self._name())

    def extras(self) -> dict[str, Any]:
        assert self._model is not None
        return model_extras(self._model.obj, self._zero)

    def close(self) -> None:
        if self._model is not None:
            self._model.close()


def _config_dtype(ds_config: Mapping[str, Any]) -> str:
    """The training dtype a stage-0 run's config names (its module is saved in it)."""
    for key, name in (("bf16", "bf16"), ("fp16", "fp16")):
        section = ds_config.get(key) if isinstance(ds_config, Mapping) else None
        if isinstance(section, Mapping) and section.get("enabled"):
            return name
    return "fp32"


def _view(tensor: torch.Tensor) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride())


def _candidates(module: Mapping[str, Any], buffer_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The module's parameters in model order: every tensor but the buffers, a tied alias (the same bytes
    as an earlier entry) left out, as ``named_parameters`` leaves it out."""
    skip = set(buffer_names)
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    out: dict[str, torch.Tensor] = {}
    for pname, value in module.items():
        if pname in skip or not torch.is_tensor(value):
            continue
        check_name(pname, "module")
        view = _view(value)
        if value.numel() and view in seen:
            continue
        seen.add(view)
        out[pname] = value
    return out


def _unflatten(
    inner: Mapping[str, Any], flats: list[torch.Tensor], trainable: list[tuple[str, torch.Tensor]], where: str
) -> tuple[dict[str, Any], list[list[torch.Tensor]]]:
    """DeepSpeed's fused FP16_Optimizer (bf16/fp16 with DeepSpeed or Apex FusedAdam) steps one flat fp32 tensor
    per param group: its members' masters one after the other in group order, no padding, and the inner
    optimizer's state entry g holds group g's flat state. The members are the module's trainable parameters in
    model order whose weight is the next slice of a group's flat master rounded to the model dtype, bit for bit;
    returned as FP16_UnfusedOptimizer keeps them (a state_dict by parameter index, masters per group), as views."""
    groups = [
        need_mapping(g, f"{where}: a param group")
        for g in need_list(inner.get("param_groups"), f"{where}: optimizer param_groups")
    ]
    if len(groups) != len(flats):
        raise InputError(f"{where}: {len(flats)} flat fp32 groups, {len(groups)} param groups: the file is damaged")
    for g, flat in enumerate(flats):
        if flat.dtype != torch.float32 or flat.dim() != 1:
            raise InputError(
                f"{where}: {_FLAT_MASTERS}[{g}] is a {flat.dtype} tensor of {flat.dim()} dims, not a flat fp32 master"
            )
    state = need_mapping(inner.get("state") or {}, f"{where}: optimizer state")
    by_index = {as_int(k, f"{where}: optimizer state index"): v for k, v in state.items()}
    at = [0] * len(flats)
    members: list[list[tuple[int, torch.Size]]] = [[] for _ in flats]
    for pname, value in trainable:
        n = value.numel()
        fits = [
            g
            for g, flat in enumerate(flats)
            if n
            and at[g] + n <= flat.numel()
            and value.is_floating_point()
            and torch.equal(flat[at[g] : at[g] + n].to(value.dtype), value.detach().reshape(-1))
        ]
        if len(fits) > 1:
            raise InputError(
                f"{where}: {pname!r} fits the flat fp32 masters of param groups {fits} alike: name the frozen "
                "parameters (--frozen NAME...) or restore from a ZeRO checkpoint of the run"
            )
        if fits:
            members[fits[0]].append((at[fits[0]], value.shape))
            at[fits[0]] += n
    short = [g for g, flat in enumerate(flats) if at[g] != flat.numel()]
    if short:
        g = short[0]
        raise InputError(
            f"{where}: the module's parameters in model order fill {at[g]} of the {flats[g].numel()} elements of "
            f"param group {g}'s flat fp32 master: the file is damaged, or its param groups do not follow the model's "
            "parameter order"
        )
    unflat: dict[int, dict[str, Any]] = {}
    out_groups: list[dict[str, Any]] = []
    masters: list[list[torch.Tensor]] = []
    for g, flat in enumerate(flats):
        flat_index = need_list(groups[g].get("params"), f"{where}: param group {g} params")
        if len(flat_index) != 1:
            raise InputError(
                f"{where}: param group {g} lists {len(flat_index)} tensors beside a flat fp32 master: the fused "
                "wrapper steps one per group; the file is damaged"
            )
        entry = need_mapping(
            by_index.get(as_int(flat_index[0], "a param group's index"), {}), f"{where}: optimizer state {g}"
        )
        first = len(unflat)
        out_groups.append({**groups[g], "params": list(range(first, first + len(members[g])))})
        masters.append([flat[start : start + shape.numel()].view(shape) for start, shape in members[g]])
        for start, shape in members[g]:
            unflat[len(unflat)] = {
                key: value[start : start + shape.numel()].view(shape)
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == flat.numel()
                else value
                for key, value in entry.items()
            }
    return {"state": unflat, "param_groups": out_groups}, masters


def _fits(want: tuple[tuple[int, ...] | None, torch.Tensor | None], value: torch.Tensor, with_values: bool) -> bool:
    shape, master = want
    if shape is not None and tuple(value.shape) != shape:
        return False
    if with_values and master is not None:
        return value.is_floating_point() and torch.equal(master.detach().to(value.dtype), value.detach())
    return True


def _place(
    want: list[list[tuple[tuple[int, ...] | None, torch.Tensor | None]]],
    candidates: list[tuple[str, torch.Tensor]],
    with_values: bool,
    where: str,
) -> list[list[str]]:
    """Each group's members as module parameter names, in model order: the earliest and the latest fitting
    embedding of the group in the candidates must be the same one (then no other exists) and groups must not
    share a parameter; otherwise refused, naming what could not be told apart."""
    out: list[list[str]] = []
    owner: dict[str, int] = {}
    for g, row in enumerate(want):
        early: list[int] = []
        at = 0
        for j, item in enumerate(row):
            while at < len(candidates) and not _fits(item, candidates[at][1], with_values):
                at += 1
            if at == len(candidates):
                shape = "unknown shape" if item[0] is None else f"shape {list(item[0])}"
                raise InputError(
                    f"{where}: param group {g} entry {j} ({shape}) matches no module parameter left in model order"
                    + (" (by shape and fp32 master value)" if with_values else " (by shape)")
                    + ": the optimizer's param groups do not follow the model's parameter order, or the file is damaged"
                )
            early.append(at)
            at += 1
        late: list[int] = []
        at = len(candidates) - 1
        for item in reversed(row):
            while not _fits(item, candidates[at][1], with_values):
                at -= 1
            late.append(at)
            at -= 1
        late.reverse()
        if early != late:
            unsure = sorted({candidates[i][0] for a, b in zip(early, late) if a != b for i in range(a, b + 1)})
            raise InputError(
                f"{where}, param group {g}: a stage-0 checkpoint does not name the parameters its optimizer state belongs to, "
                f"and {unsure[:4]} fit it in more than one way (a frozen parameter shaped like a trained one?): name "
                "the frozen parameters (--frozen NAME..., or open_reader(CKPT, frozen=[...]))"
            )
        names = [candidates[i][0] for i in early]
        for pname in names:
            if pname in owner:
                raise InputError(
                    f"{where}: {pname!r} fits both param group {owner[pname]} and param group {g}: name the frozen parameters "
                    "(Python: open_reader(CKPT, frozen=[...]))"
                )
            owner[pname] = g
        out.append(names)
    return out


def _claims_zero0(probe: Probe) -> bool:
    files = probe.deepspeed
    return files is not None and files.stage0 and files.mp == 1


def _open_zero0(probe: Probe, how: How) -> Reader:
    assert probe.deepspeed is not None  # claimed
    return Zero0Source(probe.deepspeed, optimizer=how.optimizer, frozen=how.frozen)


FORMAT = SourceFormat(
    name="deepspeed-zero0",
    label="DeepSpeed checkpoint without ZeRO (stage 0)",
    docs="format.md#stage-0-no-zero-deepspeeds-default",
    claims=_claims_zero0,
    open=_open_zero0,
    family="deepspeed",
    takes=frozenset({"frozen"}),
)
