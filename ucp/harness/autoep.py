"""One rank of a DeepSpeed AutoEP run: ``python -m ucp.harness.autoep SPEC_JSON``.

The model is a tiny Hugging Face Mixtral built from a config (random init, no download) inside a wrapper
that returns the loss. DeepSpeed's AutoEP (``expert_parallel`` config) swaps each sparse MoE block for an
``AutoEPMoELayer`` whose fused ``experts.w1/w2/w3`` hold this rank's experts. Every rank builds the whole
model from one seed and AutoEP keeps its slice, so runs at any ep size start from the same weights.

Two choices keep it on CPU with DeepSpeed 0.19.8 and transformers 5.x (dispatch is ``all_to_all_single`` on gloo):
- ``use_grouped_mm: false``, the per-expert loop: the default ``torch._grouped_mm`` path runs in torch's CPU build
  only when the expert dims are multiples of 4 fp32 elements; with the harness's deliberately odd ffn=23 it raises
  ``RuntimeError: strides should be multiple of 16 bytes`` (deepspeed/moe/ep_experts.py line 278);
- the MoE layers are named by the config's ``moe_layer_pattern`` (a custom preset), not by
  ``preset_model: "mixtral"``: that preset's adapter calls ``registry.get(key, default)`` on transformers'
  ``_CanRecordRegistry``, whose ``get`` takes one argument (auto_ep_presets/base.py line 326:
  ``TypeError: _CanRecordRegistry.get() takes 2 positional arguments but 3 were given``). The wrapper has no
  ``config`` attribute, so AutoEP does not auto-detect the Mixtral preset either. The layers and the maths
  are the same (softmax scores, top-k renormalised, applied after the experts).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from ucp.deepspeed.autoep import WEIGHTS, expert_name
from ucp.harness.expert_runs import base_config, drive, record_tail, run_expert_spec
from ucp.harness.launch import end_rank
from ucp.harness.moe import _param_groups
from ucp.harness.spec import JsonSpec, LoadSpec, ModelSpec
from ucp.harness.worker import _relink_optimizer_state, lr_decay

__all__ = ["AutoEpSpec", "AutoEpLM", "run_autoep", "MODULE"]

#: the module each rank of an AutoEP run executes
MODULE = "ucp.harness.autoep"


@dataclass
class AutoEpSpec(JsonSpec):
    """One AutoEP run on ``world`` ranks, ``ep`` of them sharing each layer's experts."""

    world: int = 2
    ep: int = 2
    experts: int = 4
    top_k: int = 2
    heads: int = 2
    stage: int = 1
    dtype: str = "fp32"
    lr: float = 1e-2
    model: ModelSpec = field(
        default_factory=lambda: ModelSpec(
            vocab=37, hidden=16, ffn=23, layers=2, tied=False, frozen=False, buffers=False
        )
    )
    global_batch: int = 4
    seq: int = 8
    seed: int = 1234
    data_seed: int = 99
    steps: int = 3
    first_step: int = 0
    load: LoadSpec | None = None
    save_dir: str | None = None
    save_tag: str | None = None
    record: str | None = None  # every rank writes its live state to RECORD.rankR.pt
    port: int = 0


class AutoEpLM(nn.Module):
    """A tiny ``MixtralForCausalLM`` (as ``lm``) whose forward returns the next-token loss."""

    def __init__(self, spec: AutoEpSpec) -> None:
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM

        m = spec.model
        config = MixtralConfig(
            vocab_size=m.vocab,
            hidden_size=m.hidden,
            intermediate_size=m.ffn,
            num_hidden_layers=m.layers,
            num_attention_heads=spec.heads,
            num_key_value_heads=1,
            head_dim=m.hidden // spec.heads,
            num_local_experts=spec.experts,
            num_experts_per_tok=spec.top_k,
            max_position_embeddings=4 * spec.seq,
            tie_word_embeddings=m.tied,
        )
        self.lm = MixtralForCausalLM(config)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=tokens[:, :-1]).logits
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _config(spec: AutoEpSpec) -> dict:
    return {
        **base_config(spec),
        "expert_parallel": {
            "enabled": True,
            "autoep_size": spec.ep,
            "moe_layer_pattern": r"lm\.model\.layers\.\d+\.mlp",
            "router_pattern": "gate",
            "expert_pattern": "experts",
            "expert_w1": "gate_up_proj",  # fused gate+up: AutoEP splits it into w1 (gate) and w3 (up)
            "expert_w2": "down_proj",
            "expert_w3": None,
            "top_k": spec.top_k,
            "use_grouped_mm": False,
        },
    }


def _expert_slices(engine: Any) -> dict[int, tuple[str, str, int, int]]:
    """id(fused expert parameter) -> (expert key prefix, weight, ep rank, local experts), from the live layers."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    out = {}
    for name, module in engine.module.named_modules():
        if isinstance(module, AutoEPMoELayer):
            for weight in WEIGHTS:
                param = getattr(module.experts, weight)
                out[id(param)] = (f"{name}.experts", weight, module.ep_rank, module.num_local_experts)
    return out


def _record(engine: Any, spec: AutoEpSpec, losses: list[float]) -> None:
    """What this rank's live engine holds per parameter: dense ones whole, each local expert's slice of a
    fused weight under its global name; every rank takes part in the gathers and writes its own record."""
    import deepspeed

    _relink_optimizer_state(engine.optimizer)  # DeepSpeed 0.19.8 links groups >= 1 too early
    base = engine.optimizer.optimizer
    keys = sorted({k for s in base.state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() == 1})
    slices = _expert_slices(engine)
    out: dict = {"losses": losses, "params": {}, "state": {k: {} for k in keys}, "module": {}}

    expert_names: dict[str, list[str]] = {}
    gathered = list(engine.module.parameters()) if spec.stage == 3 else []
    with deepspeed.zero.GatheredParameters(gathered):  # ZeRO-3: the module's own weights, whole
        _record_params(engine, out, keys, slices, expert_names)
    optimizer = engine.optimizer
    out.update(record_tail(engine, base))
    out["group_params"] = [
        [n for p in group for n in expert_names.get(engine.param_names[p], [engine.param_names[p]])]
        for group in getattr(optimizer, "bit16_groups", None) or optimizer.fp16_groups
    ]
    torch.save(out, spec.rank_record(torch.distributed.get_rank()))


def _record_params(
    engine: Any, out: dict, keys: list[str], slices: dict[int, tuple[str, str, int, int]], expert_names: dict
) -> None:
    """Each parameter's weight, fp32 master and state tensors into ``out`` (experts cut by global index)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    for name, param in engine.module.named_parameters():
        fp32 = safe_get_full_fp32_param(param)
        state = {key: safe_get_full_optimizer_state(param, key) for key in keys}
        if id(param) in slices:
            prefix, weight, ep_rank, local = slices[id(param)]
            names = [expert_name(prefix, weight, ep_rank * local + j) for j in range(local)]
            for j, global_name in enumerate(names):
                out["module"][global_name] = param[j].detach().cpu().clone()
                out["params"][global_name] = fp32[j].detach().float().cpu().clone()
                for key, value in state.items():
                    out["state"][key][global_name] = None if value is None else value[j].detach().cpu().clone()
            expert_names[name] = names
        else:
            out["module"][name] = param.detach().cpu().clone()
            out["params"][name] = fp32.detach().float().cpu().clone()
            for key, value in state.items():
                out["state"][key][name] = None if value is None else value.detach().cpu().clone()


def main(argv: list[str]) -> None:
    spec = AutoEpSpec.from_json(argv[0])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(spec.seed)
    model = AutoEpLM(spec)
    engine, *_ = deepspeed.initialize(
        model=model,
        # a callable: AutoEP replaces the expert modules inside initialize, before it builds the optimizer
        optimizer=lambda _params: torch.optim.AdamW(
            _param_groups(cast(Any, model), spec.lr),  # it reads only named_parameters
            lr=spec.lr,
            betas=(0.9, 0.95),
        ),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_decay),
        config=_config(spec),
    )
    if not _expert_slices(engine):
        raise SystemExit("AutoEP replaced no MoE layer")
    losses = drive(engine, spec)
    if spec.record:
        _record(engine, spec, losses)


def run_autoep(spec: AutoEpSpec, *, timeout: float = 900.0, log_dir: str | os.PathLike | None = None) -> None:
    """Run ``spec`` on ``spec.world`` local processes and wait for all of them."""
    run_expert_spec(spec, MODULE, timeout=timeout, log_dir=log_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
    end_rank()
