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
from collections.abc import Collection, Mapping
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
from ucp.deepspeed.optim_states import UNFUSED_MASTERS, flat_state_scalars
from ucp.errors import InputError
from ucp.io.torchfile import TorchFile
from ucp.model.detect import Detection, detect
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, Reader, SourceInfo, dtype_name
from ucp.sources.common import group_meta
from ucp.sources.format import How, Probe, SourceFormat
from ucp.sources.zero0_optimizer import entry_keys, param_groups, unwrap
from ucp.sources.zero0_placement import Want, candidates, place

__all__ = ["FORMAT", "Zero0Source"]

logger = logging.getLogger(__name__)

_MASTERS = UNFUSED_MASTERS


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

    def _facts(self, optimizer: str | None, frozen: Collection[str]) -> Facts:
        name = self._name()
        head = self._head()
        ds_config = head.get("ds_config") or {}
        module = head["module"]
        buffer_names = [str(n) for n in need_list(head.get("buffer_names") or [], f"{name}: buffer_names")]
        dtype = _config_dtype(ds_config)
        for n in frozen:
            check_name(n, "the frozen names given")
        found = candidates(module, buffer_names)
        unknown = sorted(set(frozen) - set(found))
        if unknown:
            raise InputError(f"{name}: the frozen names given list {unknown[:3]}, which its module does not hold")
        trainable = [(n, t) for n, t in found.items() if n not in set(frozen)]
        opt = need_mapping(head["optimizer"], f"{name}: optimizer")
        inner, masters, self._zero = unwrap(opt, trainable, ds_config, name)
        groups_raw, members, state = param_groups(inner, name)
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
        want = self._wanted(members, state, masters)
        placed = place(want, trainable, masters is not None, name)
        params, groups, group_steps = self._optimized(placed, members, want, module, state, groups_raw, detection)
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

    def _wanted(
        self, members: list[list[int]], state: Mapping[int, Any], masters: list[list[torch.Tensor]] | None
    ) -> list[list[Want]]:
        """Each group's members as :func:`~ucp.sources.zero0_placement.place` looks for them (shape and fp32
        master), their state keys checked to agree (``self._keys``)."""
        name = self._name()
        want: list[list[Want]] = []
        for g, indices in enumerate(members):
            keys: tuple[str, ...] | None = None
            row = []
            for j, index in enumerate(indices):
                where = f"{name}: optimizer state of param group {g} entry {j} (index {index})"
                found_keys, shape = entry_keys(state.get(index, {}), where)
                if keys is not None and found_keys != keys:
                    raise InputError(f"{where} holds {list(found_keys)}, entry 0 holds {list(keys)}: file damaged")
                keys = found_keys
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
        return want

    def _optimized(
        self,
        placed: list[list[str]],
        members: list[list[int]],
        want: list[list[Want]],
        module: Mapping[str, Any],
        state: Mapping[int, Any],
        groups_raw: list[Mapping[str, Any]],
        detection: Detection,
    ) -> tuple[list[ParamMeta], list[GroupMeta], list[int | None]]:
        """The optimized parameters as placed (each one's step, group, state and master kept), each group's
        metadata and step."""
        name = self._name()
        flavour = detection.flavour
        params: list[ParamMeta] = []
        groups: list[GroupMeta] = []
        group_steps: list[int | None] = []
        for g, indices in enumerate(members):
            names = placed[g]
            seen: set[int | None] = set()
            for j, (pname, index) in enumerate(zip(names, indices)):
                shape = want[g][j][0]
                value = need_tensor(module[pname], f"{name}: module entry {pname!r}")
                if shape is not None and tuple(value.shape) != shape:  # place matched shapes; kept as a guard
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
        return params, groups, group_steps

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
