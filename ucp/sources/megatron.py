"""A Megatron-Core ``torch_dist`` checkpoint (Megatron-LM's run folder or one iteration folder) with its distributed
optimizer's state -> :class:`~ucp.model.records.Reader` (``ucp.frameworks.megatron`` describes the files).

Call order: :class:`MegatronSource` reads ``.metadata`` and ``common.pt`` once (the args, the optimizer's sharding
type, its param groups and step), lists one parameter per model key and layer (``decoder.layers.<l>.<sub>``), and,
for ``dp_reshardable`` state, places every parameter in its model-parallel ranks' buckets
(:class:`~ucp.sources.megatron_buckets.BucketMap`). Each :meth:`~MegatronSource.read` then reads only the chunks
that overlap that parameter: its fp32 master, every state tensor; the global TP layout is the checkpoint's own (the
fused QKV rows, SwiGLU's gate rows then up rows), the same for any TP size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ucp.errors import InputError
from ucp.frameworks.dcp_chunks import DcpChunks
from ucp.frameworks.megatron import (
    COMMON,
    DP_RESHARDABLE,
    FULLY,
    LAYER_ORDERS,
    LAYERS,
    MegatronFolder,
    args_of,
    find_megatron,
    layer_name,
    split_layer,
    stage_order,
    state_key,
    tp_boxes,
)
from ucp.io.torchfile import load
from ucp.model.detect import detect
from ucp.model.hyper import hyper_from_group, raw_group
from ucp.model.layouts import MegatronRun
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, Reader, SourceInfo, dtype_name
from ucp.sources.format import How, Probe, SourceFormat
from ucp.sources.megatron_buckets import BucketMap

__all__ = ["FORMAT", "MegatronSource"]

#: common.pt entries a Megatron target writes anew; every other one is carried as it is (:attr:`MegatronRun.common`)
_COMMON_REWRITTEN = ("args", "iteration", "optimizer")


def _int(args: Mapping[str, Any], key: str, default: int = 1) -> int:
    value = args.get(key, default)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else default


class MegatronSource(Reader):
    """A torch_dist checkpoint as a reader; see the module docstring for the call order."""

    def __init__(self, folder: MegatronFolder, *, optimizer: str | None = None) -> None:
        self.folder = folder
        self.path = folder.path
        self.inputs = (folder.root or folder.path,)
        self.chunks = DcpChunks(folder.path)
        try:
            self._open(optimizer)
        except BaseException:
            self.chunks.close()
            raise

    def _open(self, optimizer: str | None) -> None:
        common = load(self.path / COMMON)
        if not isinstance(common, Mapping):
            raise InputError(f"{self.path / COMMON} holds no dict")
        args = args_of(common)
        self.tp, self.pp = _int(args, "tensor_model_parallel_size"), _int(args, "pipeline_model_parallel_size")
        dp = _int(args, "data_parallel_size", 0) or max(1, _int(args, "world_size") // (self.tp * self.pp))
        optim = common.get("optimizer")
        if not isinstance(optim, Mapping) or "param_state_sharding_type" not in optim:
            raise InputError(
                f"{self.path} holds no distributed optimizer state (saved with --no-save-optim, or without "
                "--use-distributed-optimizer): ucp moves a run with its optimizer; ucp export reads its weights"
            )
        self.sharding = str(optim["param_state_sharding_type"])
        if self.sharding not in (FULLY, DP_RESHARDABLE):
            raise InputError(
                f"{self.path}: optimizer state sharded as {self.sharding!r}; ucp reads {FULLY} and {DP_RESHARDABLE}"
            )
        entries = self.chunks.entries
        tensors = {k: m for k, m in entries.items() if hasattr(m, "chunks")}
        self._model = {k: m for k, m in tensors.items() if not k.startswith("optimizer.")}
        experts = [k for k in self._model if ".experts." in k or k.startswith("model") and k[5:6].isdigit()]
        if experts:
            raise InputError(f"{self.path}: {experts[0]} (experts or virtual pipeline chunks) is not read by ucp yet")
        self._shapes = self._param_shapes()
        swiglu = bool(args.get("swiglu", False))
        self._boxes = {n: self._tp_boxes(n, swiglu) for n in self._shapes}
        self.buckets = None
        if self.sharding == DP_RESHARDABLE:
            layers = _int(args, "num_layers", 0) or max((split_layer(n)[1] or 0) + 1 for n in self._shapes)
            self.buckets = BucketMap(
                self.chunks, self._shapes, self._boxes, tp=self.tp, pp=self.pp, dp=dp, layers=layers
            )
            groups, states = self.buckets.param_groups(), self.buckets.states
        else:
            groups = list((optim.get("optimizer") or {}).get("param_groups") or [])
            states = sorted({k.split(".")[2] for k in tensors if k.startswith("optimizer.state.")} - {"param"})
        objects = {k: self.chunks.item(k) for k in entries if "._extra_state/shard_" in k}
        rng = {k: self.chunks.raw(k) for k in entries if k.startswith("rng_state/shard_")}
        kept = {k: v for k, v in common.items() if k not in _COMMON_REWRITTEN}
        run = MegatronRun(args, self.sharding, self.tp, self.pp, dp, kept, objects, rng)
        self.facts = self._facts(args, run, groups, states, optimizer)

    def _param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter (one per model key and layer) with its shape, in forward order."""
        shapes: dict[str, tuple[int, ...]] = {}
        for key, meta in self._model.items():
            size = tuple(meta.size)
            if key.startswith(LAYERS):
                shapes.update({layer_name(key, layer): size[1:] for layer in range(size[0])})
            else:
                shapes[key] = size
        layers = range(max((split_layer(n)[1] or 0) + 1 for n in shapes))
        order = stage_order(shapes, layers, 0, 1, LAYER_ORDERS["local"])
        return {n: shapes[n] for n in order + [n for n in shapes if n not in order]}

    def _tp_boxes(self, name: str, swiglu: bool) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
        key, layer = split_layer(name)
        return tp_boxes(key, self._model[key].chunks, layer, self.tp, swiglu)

    def _facts(
        self,
        args: Mapping[str, Any],
        run: MegatronRun,
        groups: list[dict[str, Any]],
        states: list[str],
        override: str | None,
    ) -> Facts:
        if not groups:
            raise InputError(f"{self.path}: the optimizer's param groups are missing")
        steps = {float(g["step"]) for g in groups if "step" in g}
        if len(steps) > 1:
            raise InputError(f"{self.path}: param groups at different steps {sorted(steps)}")
        step = int(steps.pop()) if steps else None
        state = {"step": torch.tensor(float(step or 0)), **{k: torch.empty(1) for k in states}}
        detection = detect({"param_groups": groups, "state": {0: state}}, None, override)
        members = self._members(groups)
        dtype = dtype_name(next(iter(self._model.values())).properties.dtype)
        metas = [
            GroupMeta(i, hyper_from_group(g, detection.adam_w_mode), raw_group(g), members[i], step, tuple(states))
            for i, g in enumerate(groups)
        ]
        params = [ParamMeta(n, self._shapes[n], dtype, g.index, False) for g in metas for n in g.params]
        info = SourceInfo(
            format="megatron",
            zero_stage=1,
            dp_world_size=run.dp,
            mp_world_size=self.tp * self.pp,
            dtype=dtype,
            global_steps=int(self.folder.iteration or args.get("iteration") or 0),
            global_samples=args.get("consumed_train_samples")
            if isinstance(args.get("consumed_train_samples"), int)
            else None,
            iteration=self.folder.iteration,
        )
        return Facts(
            info=info,
            flavour=detection.flavour.name if detection.flavour else None,
            adam_w_mode=detection.adam_w_mode,
            step=step,
            groups=metas,
            params=params,
            warnings=list(detection.warnings),
            megatron=run,
        )

    def _members(self, groups: list[dict[str, Any]]) -> list[list[str]]:
        """Each group's parameters by Megatron's rule (``_get_param_groups``): no weight decay (``wd_mult`` 0) for
        1-D parameters and biases, the rest decays; a group told apart by anything else is refused."""
        odd = [
            i
            for i, g in enumerate(groups)
            if g.get("lr_mult", 1.0) != 1.0 or g.get("is_expert_parallel") or g.get("is_decoupled_lr")
        ]
        if odd or len(groups) > 2:
            raise InputError(f"{self.path}: param groups {odd or list(range(len(groups)))} are set apart by lr_mult, "
                             "experts or a decoupled lr; ucp assigns parameters to Megatron's default groups only")  # fmt: skip
        no_wd = [n for n, s in self._shapes.items() if len(s) == 1 or n.endswith(".bias")]
        if len(groups) == 1:
            return [list(self._shapes)]
        mults = [float(g.get("wd_mult", 1.0)) for g in groups]
        if sorted(mults) != [0.0, 1.0]:
            raise InputError(
                f"{self.path}: two param groups with wd_mult {mults}; ucp knows Megatron's 1.0 / 0.0 split"
            )
        rest = [n for n in self._shapes if n not in set(no_wd)]
        return [no_wd if m == 0.0 else rest for m in mults]

    # -- reading ------------------------------------------------------------------------------
    def _model_tensor(self, name: str) -> torch.Tensor:
        key, layer = split_layer(name)
        shape = self._shapes[name]
        if layer is None:
            return self.chunks.region(key, (0,) * len(shape), shape)
        return self.chunks.region(key, (layer,) + (0,) * len(shape), (1, *shape))[0]

    def _state(self, name: str, state: str) -> torch.Tensor:
        if self.buckets is not None:
            return self.buckets.read(name, self._shapes[name], state)
        key, layer = split_layer(name)
        shape = self._shapes[name]
        if layer is None:
            return self.chunks.region(state_key(state, key), (0,) * len(shape), shape)
        return self.chunks.region(state_key(state, key), (layer,) + (0,) * len(shape), (1, *shape))[0]

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        meta = self.facts.param(name)
        group = self.facts.groups[meta.group] if meta.group is not None else None
        fp32 = self._state(name, "param").float()
        if self.buckets is not None:  # a placement that is not Megatron's would not give the model's own weight
            weight = self._model_tensor(name)
            if not torch.equal(fp32.to(weight.dtype), weight):
                raise InputError(
                    f"{self.path}: the optimizer's master of {name} is not the model's weight: the buckets are laid "
                    f"out otherwise than ucp rebuilt them ({self.buckets.order} layer order); refused"
                )
        if group is None or not moments:
            return ParamState(fp32=fp32, step=group.step if group else None)
        optim = {k: self._state(name, k).float() for k in group.state_keys}
        return ParamState(fp32=fp32, optim=optim, step=group.step)

    def buffers(self) -> dict[str, torch.Tensor]:
        return {}

    def extras(self) -> dict[str, Any]:
        return {"client_state": {}}

    def close(self) -> None:
        self.chunks.close()


def _open(probe: Probe, how: How) -> Reader:
    folder = find_megatron(probe.path)
    assert folder is not None  # claimed
    return MegatronSource(folder, optimizer=how.optimizer)


FORMAT = SourceFormat(
    name="megatron",
    label="Megatron-Core torch_dist checkpoint (distributed optimizer)",
    docs="format.md#9-megatron-core-torch_dist",
    claims=lambda probe: find_megatron(probe.path) is not None,
    open=_open,
    refines=("dcp",),
)
