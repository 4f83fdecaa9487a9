"""What megatron-core 0.16.1 needs to train and checkpoint on CPU ranks (gloo), for tests/support/megatron_worker.py.

Two functions, both applied once per rank before any Megatron object is built:

* :func:`patch_for_cpu`: every CPU-only redirection (``torch.cuda`` helpers, hard-coded ``device='cuda'``, the
  CUDA RNG tracker). Nothing it changes reaches the checkpoint files except that the saved ``cuda_rng_state``
  and tracker states are CPU generator states.
* :func:`fix_load_path`: four fixes of megatron-core 0.16.1's DistributedOptimizer *load* path with torch's Adam
  (no Transformer Engine / Apex: every CPU run, and GPU installs without them). These are Megatron bugs, not
  CUDA issues; saving is unaffected. Switched off by ``MegatronSpec.load_fixes=False`` (then 0.16.1's own
  errors, or its silently wrong Adam step, show).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["fix_load_path", "patch_for_cpu"]

_CPU_TYPES = {"torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor"}


def _cpu_device(device: Any) -> Any:
    """``device`` with any CUDA device (a torch.device, 'cuda[:N]' or a bare index) replaced by the CPU."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    return device


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    """Rewrites the CUDA-only torch calls megatron-core makes (DDP buffers, DistributedOptimizer,
    MixedPrecisionOptimizer, clip_grads, dist_checkpointing): ``device=`` CUDA -> CPU, ``Tensor.to(cuda)`` ->
    CPU, ``Tensor.cuda()`` a no-op, and ``Tensor.type()`` reporting ``torch.cuda.FloatTensor`` for a CPU float
    tensor (the optimizer asserts on these names)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if name in _CPU_TYPES else name
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1 and not isinstance(args[1], (torch.dtype, torch.Tensor)):
            args = (args[0], _cpu_device(args[1]), *args[2:])
        return func(*args, **kwargs)


def patch_for_cpu() -> None:
    """Make megatron-core 0.16.1 run on CPU ranks. **Does not change the on-disk checkpoint format**: it only
    redirects CUDA calls to the CPU; what Megatron puts in a checkpoint and how it lays it out are untouched
    (the only visible trace: ``rng_state``'s ``cuda_rng_state`` and tracker states hold CPU generator states).

    1. ``torch.cuda.current_device()`` answers 'cpu' (Megatron passes it as ``device=``); ``synchronize`` and
       ``empty_cache`` are no-ops.
    2. A TorchFunctionMode (entered for the life of the rank) maps hard-coded CUDA devices to the CPU, see
       :class:`_CudaToCpu`.
    3. Megatron's CUDA RNG tracker and ``torch.cuda`` RNG calls use the CPU generator (same semantics: named
       states and ``fork()``). ``torch.cuda.manual_seed_all`` must stay a no-op: ``torch.manual_seed`` calls
       it, and pointing it at the CPU generator would recurse.
    """
    import megatron.core.tensor_parallel.random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.empty_cache = lambda *a, **k: None  # type: ignore[assignment]

    _CudaToCpu().__enter__()  # never left: the rank process ends with it active

    def get_state(*args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        torch.set_rng_state(state)

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    torch.cuda.get_rng_state = get_state  # type: ignore[assignment]
    torch.cuda.set_rng_state = set_state  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]


def fix_load_path() -> bool:
    """**megatron-core 0.16.1 load-path fixes** (DistributedOptimizer with torch Adam, i.e. without TE/Apex).
    Returns False (and patches nothing) where TE or Apex is present, since 0.16.1 then takes its other path.

    Unfixed, 0.16.1 fails or drifts on load (observed here):
      (a) a never-stepped optimizer's ``sharded_state_dict(is_loading=True)`` -> ``assert len(steps) == 1``;
      (b) dp_reshardable + fp32 params: ``_set_main_param_and_optimizer_states`` copies into a view of a leaf
          that requires grad -> "a view of a leaf Variable that requires grad is being used in an in-place
          operation" (``load_parameter_state_from_dp_reshardable`` lacks ``@torch.no_grad``);
      (c) fully_reshardable: ``KeyError: 'step'`` (its loader passes no per-param step);
      (d) silent: ``load_state_dict`` gives every param ONE shared ``step`` tensor (torch Adam then adds 1 per
          param per step) and the dp_reshardable loader overwrites it with the fresh optimizer's step, so the
          losses after resume drift (4.854348 instead of 4.865066 one step after a resume at step 3).
    """
    from megatron.core.optimizer import distrib_optimizer as dmod

    if dmod.HAVE_APEX_OR_TE:
        return False
    optimizer_class = dmod.DistributedOptimizer
    sharded_state_dict = optimizer_class.sharded_state_dict
    load_state_dict = optimizer_class.load_state_dict
    set_states = optimizer_class._set_main_param_and_optimizer_states

    def fixed_sharded_state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        # (a) prime a fresh optimizer with Megatron's own helper; the load overwrites all it touches
        if kwargs.get("is_loading", len(args) > 1 and args[1]) and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()
        return sharded_state_dict(self, *args, **kwargs)

    def fixed_load_state_dict(self: Any, state_dict: Any) -> None:
        with torch.no_grad():  # (b)
            load_state_dict(self, state_dict)
        for group in self.optimizer.param_groups:  # (d) an independent per-param step: the checkpoint's
            for param in group["params"]:
                state = self.optimizer.state.get(param)
                if state and "step" in state and "step" in group:
                    state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)

    def fixed_set_states(self: Any, model_param: Any, tensors: dict[str, Any]) -> Any:
        # (c) keep the step the optimizer already holds
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][order]]
            if "step" in state:
                tensors = dict(tensors, step=state["step"])
        return set_states(self, model_param, tensors)

    optimizer_class.sharded_state_dict = fixed_sharded_state_dict
    optimizer_class.load_state_dict = fixed_load_state_dict
    optimizer_class._set_main_param_and_optimizer_states = fixed_set_states
    return True
