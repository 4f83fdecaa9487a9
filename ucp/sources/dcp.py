"""A torch.distributed.checkpoint (DCP) folder -> :class:`~ucp.model.records.Reader`.

The folder is what an FSDP2 run (or ``ucp restore --format dcp``) saves with
``dcp.save({"model": model_sd, "optim": optim_sd, ...})`` where both state dicts come from
``torch.distributed.checkpoint.state_dict.get_state_dict``: model keys are FQNs, the optimizer
state is keyed by FQN, ``param_groups`` list their members' FQNs (docs/format.md, section 6).

Call order: :class:`DcpSource` reads ``.metadata`` with an unpickler that builds only DCP's own
metadata classes (no general unpickling), checks that every shard file it names is there and long
enough, and loads the small items (param groups, steps, scheduler, counters) once. Each
:meth:`DcpSource.read` then asks DCP's own loader for one parameter's tensors, so memory stays near
the largest parameter; byte items are unpickled with ``weights_only=True`` only.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ucp.deepspeed.states import scaler_object
from ucp.errors import InputError
from ucp.frameworks.dcp import (
    MODEL,
    OPTIM,
    SCHEDULER,
    TRAIN_STATE,
    UCP_KEY,
    DcpStore,
    StateStore,
    is_dcp,
)
from ucp.model.detect import detect
from ucp.model.hyper import hyper_from_group, raw_group
from ucp.model.loss_scale import LossScale
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, Reader, SourceInfo, dtype_name
from ucp.sources.format import How, Probe, SourceFormat

__all__ = ["FORMAT", "DcpSource"]

logger = logging.getLogger(__name__)

#: what ucp reads of ``train_state`` (DeepSpeed's counters, and an fp16 run's scaler that ucp's writer keeps there)
_TRAIN_STATE_READ = frozenset({"step", "skipped_steps", "global_samples", "loss_scale"})


def _nest(items: Mapping[tuple[Any, ...], Any]) -> dict[Any, Any]:
    """A nested dict from key paths (DCP's planner_data) and leaf values; list indices become
    strings, as DCP's own flattening names them."""
    root: dict[Any, Any] = {}
    for path, value in items.items():
        node = root
        for part in path[:-1]:
            node = node.setdefault(str(part), {})
        node[str(path[-1])] = value
    return root


def _as_list(node: Any, what: str) -> list[Any]:
    """A list that DCP flattened into {0: ..., 1: ...}."""
    if not isinstance(node, Mapping) or set(node) != {str(i) for i in range(len(node))}:
        raise InputError(f"{what} is not a list")
    return [node[str(i)] for i in range(len(node))]


class DcpSource(Reader):
    """A DCP folder of ``get_state_dict`` shape as a reader; see the module docstring for the call order.

    ``names`` tells parameters from buffers and tied aliases when the folder does not record it
    (ucp's own DCP output records it under ``ucp``): ``{"tied": {alias: owner}, "buffers": [...],
    "frozen": [...]}``; ``frozen`` alone names the frozen parameters and leaves the rest to detection.
    Without either, an entry the optimizer does not hold is a tied alias when it equals a trained
    parameter, a frozen parameter when FSDP sharded it (several chunks), else a buffer.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        optimizer: str | None = None,
        names: Mapping[str, Any] | None = None,
        store: StateStore | None = None,
    ):
        self.path = Path(path)
        self.inputs = (self.path,)
        #: the state dict's folders (``path`` alone, unless a store of several is given: a Trainer FSDP folder's)
        self.store: StateStore = store or DcpStore([(self.path, {})])
        self._paths: dict[tuple[Any, ...], Any] = self.store.paths  # key path -> its storage metadata
        self._model = {p[1]: s for p, s in self._paths.items() if len(p) == 2 and p[0] == MODEL}
        if not self._model:
            raise InputError(
                f"{self.path} holds no 'model' state: ucp reads DCP folders saved as "
                '{"model": ..., "optim": ...} from get_state_dict'
            )
        small = self._load_small()
        self._extras = {k: small.get(k) for k in (SCHEDULER, TRAIN_STATE)}
        self._scalars: dict[str, dict[str, torch.Tensor]] = small.get(OPTIM, {}).get("state", {})
        recorded = json.loads(small[UCP_KEY]) if isinstance(small.get(UCP_KEY), str) else {}
        facts = self._facts(small, {**recorded, **dict(names or {})}, optimizer)
        unread = self._unread(small)
        self.facts = dataclasses.replace(facts, warnings=[*facts.warnings, unread]) if unread else facts

    def _unread(self, small: Mapping[str, Any]) -> str | None:
        """What the folder holds besides what ucp reads (a run's own entries, a dataloader's state), said in a note:
        none of it reaches an output."""
        entries = sorted({str(p[0]) for p in self._paths} - {MODEL, OPTIM, SCHEDULER, TRAIN_STATE, UCP_KEY})
        train = small.get(TRAIN_STATE)
        counters = sorted(set(train) - _TRAIN_STATE_READ) if isinstance(train, Mapping) else []
        unread = entries + [f"{TRAIN_STATE}.{k}" for k in counters]
        if not unread:
            return None
        return (
            f"not carried: {', '.join(unread[:8])}{' ...' if len(unread) > 8 else ''} (entries of the DCP folder "
            "beside model, optim, lr_scheduler and train_state's counters, which no output holds)"
        )

    # -- opening ------------------------------------------------------------------------------
    def _tensor_meta(self, where: tuple[Any, ...]) -> Any:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        storage = self._paths.get(where)
        return storage if isinstance(storage, TensorStorageMetadata) else None

    def _load_small(self) -> dict[str, Any]:
        """Everything but the model's and the optimizer's per-element tensors: groups, 0-dim state
        (steps, NAdam's mu_product), scheduler, counters, ucp's own record."""
        template: dict[tuple[Any, ...], Any] = {}
        for where in self._paths:
            tensor = self._tensor_meta(where)
            big = tensor is not None and len(tensor.size) > 0
            if where[0] == MODEL or (big and where[:2] == (OPTIM, "state")):
                continue
            template[where] = (
                torch.empty(tuple(tensor.size), dtype=tensor.properties.dtype) if tensor is not None else None
            )
        nested = _nest(template)
        self.store.load(nested)
        return nested

    def _groups(self, small: Mapping[str, Any]) -> list[dict[str, Any]]:
        raw = small.get(OPTIM, {}).get("param_groups")
        groups = _as_list(raw, "optim.param_groups") if raw is not None else []
        for i, group in enumerate(groups):
            members = group.get("params") if isinstance(group, Mapping) else None
            if not isinstance(members, list) or not all(isinstance(n, str) for n in members):
                raise InputError(f"{self.path}: optim.param_groups[{i}] lists no parameter names (FQNs)")
            missing = [n for n in members if n not in self._model]
            if missing:
                raise InputError(
                    f"{self.path}: optim.param_groups[{i}] names {missing[:3]}, which the model state does not hold"
                )
        return [dict(g) for g in groups]

    def _state_keys(self, name: str) -> tuple[str, ...]:
        """The optimizer's per-element state keys of one parameter, checked against its shape."""
        keys = []
        shape = tuple(self._model[name].size)
        for where in self._paths:
            if len(where) == 4 and where[:3] == (OPTIM, "state", name):
                tensor = self._tensor_meta(where)
                if tensor is not None and len(tensor.size) > 0:
                    if tuple(tensor.size) != shape:
                        raise InputError(
                            f"{self.path}: optimizer state {where[3]!r} of {name} has shape {tuple(tensor.size)}, "
                            f"the parameter {shape}: not elementwise state, which ucp cannot carry"
                        )
                    keys.append(where[3])
        return tuple(keys)

    def _facts(self, small: Mapping[str, Any], names: Mapping[str, Any], optimizer: str | None) -> Facts:
        groups = self._groups(small)
        state_names = {p[2] for p in self._paths if len(p) == 4 and p[:2] == (OPTIM, "state")}
        stray = sorted(state_names - self._model.keys())
        if stray:
            raise InputError(f"{self.path}: the optimizer holds state for {stray[:3]}, which the model state does not")
        trained = [n for g in groups for n in g["params"]]
        tied, buffers, warnings = self._classify(set(trained), names)
        detection = detect({"param_groups": groups, "state": dict(enumerate(self._scalars.values()))}, None, optimizer)
        first = next(iter(self._model.values()))
        dtype = str(names.get("dtype") or dtype_name(first.properties.dtype))
        steps = {
            n: detection.flavour.read_step({}, self._scalars.get(n, {})) if detection.flavour else None for n in trained
        }
        group_metas = self._group_metas(groups, steps, detection.adam_w_mode)
        metas = [ParamMeta(n, tuple(self._model[n].size), dtype, g.index, False) for g in group_metas for n in g.params]
        frozen = [n for n in self._model if n not in set(trained) | set(tied) | set(buffers)]
        metas += [ParamMeta(n, tuple(self._model[n].size), dtype, None, True) for n in frozen]
        return Facts(
            info=self._info(small, dtype, steps),
            flavour=detection.flavour.name if detection.flavour else None,
            adam_w_mode=detection.adam_w_mode,
            step=max((s for s in steps.values() if s is not None), default=None),
            groups=group_metas,
            params=metas,
            tied=tied,
            buffer_names=buffers,
            warnings=warnings + detection.warnings,
        )

    def _group_metas(
        self, groups: list[dict[str, Any]], steps: Mapping[str, int | None], adam_w_mode: bool | None
    ) -> list[GroupMeta]:
        """Each param group as the pipeline's record; its members must agree on their step."""
        out = []
        for i, group in enumerate(groups):
            members = list(group["params"])
            known = sorted({s for n in members if (s := steps[n]) is not None})
            if len(known) > 1:
                raise InputError(f"{self.path}: param group {i} holds parameters at different steps {known}")
            per_member = {n: self._state_keys(n) for n in members}
            keys = per_member[members[0]] if members else ()
            odd = [n for n, k in per_member.items() if set(k) != set(keys)]
            if odd:  # a group's members keep one set of keys; never take one member's as the group's
                raise InputError(
                    f"{self.path}: param group {i}: {odd[0]} keeps optimizer state {sorted(per_member[odd[0]])}, "
                    f"{members[0]} keeps {sorted(keys)}; ucp carries one set of keys per group"
                )
            hyper = hyper_from_group(group, adam_w_mode)
            raw = raw_group(group)
            out.append(GroupMeta(i, hyper, raw, members, step=known[0] if known else None, state_keys=keys))
        return out

    def _classify(self, trained: set[str], names: Mapping[str, Any]) -> tuple[dict[str, str], list[str], list[str]]:
        """(tied aliases, buffer names, warnings) of the model entries the optimizer does not hold;
        every other entry is a frozen parameter, so nothing is dropped."""
        frozen = [str(n) for n in names.get("frozen") or []]
        self._check_named(trained, frozen, names)
        if "buffers" in names or "tied" in names:
            tied = {str(a): str(o) for a, o in dict(names.get("tied") or {}).items() if a not in frozen}
            return tied, [str(b) for b in names.get("buffers") or [] if b not in frozen], []
        tied = {}
        rest = [n for n in self._model if n not in trained and n not in frozen]
        for alias in rest:
            for owner in trained:
                if self._same(alias, owner):
                    tied[alias] = owner
                    break
        buffers = [n for n in rest if n not in tied and len(self._model[n].chunks) == 1]
        warnings = []
        if buffers and all(len(s.chunks) == 1 for s in self._model.values()):
            warnings.append(
                f"one rank wrote {self.path}, so frozen parameters and buffers look alike; read {buffers[:3]} "
                "as buffers (name the frozen ones: to-universal --frozen NAME...)"
            )
        return tied, buffers, warnings

    def _check_named(self, trained: set[str], frozen: list[str], names: Mapping[str, Any]) -> None:
        """Every name given is a model entry, and a frozen one is not trained."""
        tied = dict(names.get("tied") or {})
        given = {*frozen, *(str(b) for b in names.get("buffers") or []), *map(str, tied), *map(str, tied.values())}
        unknown = sorted(given - self._model.keys())
        if unknown:
            raise InputError(f"{self.path}: the names given list {unknown[:3]}, which the model state does not hold")
        trained_frozen = sorted(set(frozen) & trained)
        if trained_frozen:
            raise InputError(
                f"{self.path}: {trained_frozen[:3]} are trained (the optimizer holds them), so not frozen parameters"
            )

    def _same(self, alias: str, owner: str) -> bool:
        a, b = self._model[alias], self._model[owner]
        if tuple(a.size) != tuple(b.size) or a.properties.dtype != b.properties.dtype:
            return False
        return torch.equal(self._model_tensor(alias), self._model_tensor(owner))

    def _info(self, small: Mapping[str, Any], dtype: str, steps: Mapping[str, int | None]) -> SourceInfo:
        found = small.get(TRAIN_STATE)
        train: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        step = max((s for s in steps.values() if s is not None), default=0)
        return SourceInfo(
            format="dcp",
            zero_stage=3,
            dp_world_size=max(1, self.store.writers(MODEL)),
            dtype=dtype,
            global_steps=int(train.get("step", step)),
            skipped_steps=int(train.get("skipped_steps", 0)),
            global_samples=int(train["global_samples"]) if "global_samples" in train else None,
        )

    # -- reading ------------------------------------------------------------------------------
    def _model_tensor(self, name: str) -> torch.Tensor:
        storage = self._model[name]
        tensor = torch.empty(tuple(storage.size), dtype=storage.properties.dtype)
        self.store.load({MODEL: {name: tensor}})
        return tensor

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        meta = self.facts.param(name)
        keys = self.facts.groups[meta.group].state_keys if moments and meta.group is not None else ()
        fp32 = torch.empty(meta.shape, dtype=self._model[name].properties.dtype)
        optim = {
            k: torch.empty(meta.shape, dtype=self._tensor_meta((OPTIM, "state", name, k)).properties.dtype)
            for k in keys
        }
        template: dict[str, Any] = {MODEL: {name: fp32}}
        if optim:
            template[OPTIM] = {"state": {name: optim}}
        self.store.load(template)
        step = self.facts.groups[meta.group].step if meta.group is not None else None
        if not keys:
            return ParamState(fp32=fp32.float(), step=step)
        own = self._scalars.get(name, {})
        scalars = {k: v for k, v in own.items() if k != "step" and torch.is_tensor(v) and v.dim() == 0}
        return ParamState(fp32=fp32.float(), optim={k: v.float() for k, v in optim.items()}, step=step, scalars=scalars)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {name: self._model_tensor(name) for name in self.facts.buffer_names}

    def close(self) -> None:
        self.store.close()

    def extras(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lr_scheduler": self._extras.get(SCHEDULER), "client_state": {}}
        train = self._extras.get(TRAIN_STATE)
        saved = train.get("loss_scale") if isinstance(train, Mapping) else None
        if isinstance(saved, Mapping):  # an fp16 DeepSpeed run's scaler, kept by ucp's DCP writer
            try:
                scale = LossScale.from_fields(saved)
            except TypeError as err:
                raise InputError(f"{self.path}: train_state.loss_scale is not a loss scale ({err})") from None
            if scale.problem() is not None:
                raise InputError(f"{self.path}: train_state.loss_scale is damaged: {scale.problem()}")
            out["loss_scaler"] = scaler_object(scale)
            out["dynamic_loss_scale"] = scale.dynamic
        return out


def _open_dcp(probe: Probe, how: How) -> Reader:
    return DcpSource(probe.path, optimizer=how.optimizer, names={"frozen": list(how.frozen)} if how.frozen else None)


FORMAT = SourceFormat(
    name="dcp",
    label="torch.distributed.checkpoint folder (FSDP2, torchtitan)",
    docs="format.md#6-torchdistributedcheckpoint-fsdp2",
    claims=lambda probe: is_dcp(probe.path),
    open=_open_dcp,
    takes=frozenset({"frozen"}),
)
