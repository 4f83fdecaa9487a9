"""One rank of a mixture-of-experts harness run: ``python -m ucp.harness.moe SPEC_JSON``.

The model is TinyLM's embedding, one legacy ``deepspeed.moe.layer.MoE`` layer (top-1 gate, MLP experts)
with a residual, a LayerNorm and a head. Each expert is initialised from its *global* index, so runs at
any expert-parallel size start from the same weights; tokens are never dropped and the gate's auxiliary
loss is left out of the loss (it is a product of per-rank means), so a step's result does not depend on
how the batch is split across ranks: runs at other world and ep sizes are comparable.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from ucp.harness.expert_runs import base_config, drive, record_tail, run_expert_spec
from ucp.harness.launch import end_rank
from ucp.harness.model import build_param_groups
from ucp.harness.spec import JsonSpec, LoadSpec, ModelSpec
from ucp.harness.worker import _relink_optimizer_state, _stage0_state, lr_decay

__all__ = ["MoeSpec", "MoeLM", "run_moe", "global_name", "MODULE"]

#: the module each rank of a MoE run executes
MODULE = "ucp.harness.moe"
_LOCAL = re.compile(r"^(.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(\d+)(\..*)$")


@dataclass
class MoeSpec(JsonSpec):
    """One MoE run on ``world`` ranks, ``ep`` of them sharing each layer's experts."""

    world: int = 4
    ep: int = 2
    experts: int = 4
    stage: int = 2
    dtype: str = "fp32"
    lr: float = 1e-2
    model: ModelSpec = field(default_factory=lambda: ModelSpec(layers=0, tied=False, frozen=False, buffers=False))
    global_batch: int = 8
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


class _Expert(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class MoeLM(nn.Module):
    """Embedding -> x + MoE(x) -> LayerNorm -> head."""

    def __init__(self, spec: MoeSpec) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        m = spec.model
        self.embed = nn.Embedding(m.vocab, m.hidden)
        self.moe = MoE(
            hidden_size=m.hidden,
            expert=_Expert(m.hidden, m.ffn),
            num_experts=spec.experts,
            ep_size=spec.ep,
            k=1,
            min_capacity=1,
            drop_tokens=False,  # every token reaches its expert: no capacity effects across ep sizes
            use_rts=False,
        )
        self.norm = nn.LayerNorm(m.hidden)
        self.head = nn.Linear(m.hidden, m.vocab, bias=False)

    def init_experts(self, seed: int, ep_rank: int) -> None:
        """Each local expert from its global index's seed (MoE deep-copies one expert into every slot)."""
        local = self.moe.num_local_experts
        for j, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
            torch.manual_seed(seed + 1000 + ep_rank * local + j)
            for layer in (expert.fc1, expert.fc2):
                layer.reset_parameters()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        y, _aux, _counts = self.moe(x)
        logits = self.head(self.norm(x + y))
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def global_name(name: str, ep_rank: int, local: int) -> str:
    """A module name with its local expert index replaced by the global one (as DeepSpeed's expert files name it)."""
    m = _LOCAL.match(name)
    if m is None:
        return name
    return f"{m.group(1)}{ep_rank * local + int(m.group(2))}{m.group(3)}"


def _param_groups(model: MoeLM, lr: float) -> list[dict]:
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    groups = build_param_groups(model, 2, lr)
    for g, group in enumerate(groups):
        group["name"] = ("decay", "no_decay")[g]
    return split_params_into_different_moe_groups_for_optimizer(groups)


def _record(engine, spec: MoeSpec, losses: list[float], ep_rank: int) -> None:
    """What this rank's live engine holds per parameter (dense ones and its local experts, under global
    names); every rank takes part in the gathers and writes its own record."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _relink_optimizer_state(engine.optimizer)  # DeepSpeed 0.19.8 links groups >= 1 too early
    zero = spec.stage > 0
    base = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    keys = sorted({k for s in base.state.values() for k, v in s.items() if torch.is_tensor(v) and v.dim() == 1})
    local = engine.module.moe.num_local_experts
    out: dict = {"losses": losses, "params": {}, "state": {k: {} for k in keys}, "module": {}, "ep_rank": ep_rank}
    for name, param in engine.module.named_parameters():
        name = global_name(name, ep_rank, local)
        out["module"][name] = param.detach().cpu().clone()
        if zero:
            fp32 = safe_get_full_fp32_param(param)
            states = {key: safe_get_full_optimizer_state(param, key) for key in keys}
        else:  # no ZeRO: no fragment mapping to gather through
            fp32, states = _stage0_state(engine, param, keys)
        out["params"][name] = fp32.detach().float().cpu().clone()
        for key, value in states.items():
            out["state"][key][name] = None if value is None else value.detach().cpu().clone()
    out.update(record_tail(engine, base))
    groups = engine.optimizer.bit16_groups if zero else [g["params"] for g in base.param_groups]
    out["group_params"] = [[global_name(engine.param_names[p], ep_rank, local) for p in group] for group in groups]
    torch.save(out, spec.rank_record(torch.distributed.get_rank()))


def main(argv: list[str]) -> None:
    spec = MoeSpec.from_json(argv[0])
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(spec.seed)
    model = MoeLM(spec)
    # DeepSpeed forms expert-parallel groups of consecutive ranks (0.19.8 groups._create_expert_and_data_parallel);
    # they exist only after initialize, which already copies the weights into the fp32 masters
    ep_rank = torch.distributed.get_rank() % spec.ep
    model.init_experts(spec.seed, ep_rank)
    optimizer = torch.optim.AdamW(_param_groups(model, spec.lr), lr=spec.lr, betas=(0.9, 0.95))
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_decay),
        config=base_config(spec),
    )
    if groups._get_expert_parallel_rank(model.moe.expert_group_name) != ep_rank:
        raise SystemExit("DeepSpeed grouped the expert-parallel ranks otherwise than the harness assumed")
    losses = drive(engine, spec)
    if spec.record:
        _record(engine, spec, losses, ep_rank)


def run_moe(spec: MoeSpec, *, timeout: float = 900.0, log_dir: str | os.PathLike | None = None) -> None:
    """Run ``spec`` on ``spec.world`` local processes and wait for all of them."""
    run_expert_spec(spec, MODULE, timeout=timeout, log_dir=log_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
    end_rank()
