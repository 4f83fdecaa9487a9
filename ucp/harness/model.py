"""The harness model: tiny, deterministic, and carrying every feature a ZeRO checkpoint can hold."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ucp.harness.spec import ModelSpec

__all__ = ["TinyLM", "GluBlock", "tp_layer_specs", "build_param_groups", "batch_for_step", "spec_batch"]


class GluBlock(nn.Module):
    """SwiGLU MLP with the gate and up projections fused in one weight, as Llama-style checkpoints store it."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 2 * ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


def tp_layer_specs(spec: ModelSpec) -> list[dict]:
    """DeepSpeed AutoTP rules for TinyLM: column-parallel first projection, row-parallel second."""
    if spec.glu:
        return [
            {
                "patterns": [r".*\.up\.weight$", r".*\.up\.bias$"],
                "partition_type": "column",
                "shape": [2, -1],
                "partition_dim": 0,
            },
            {"patterns": [r".*\.down\.weight$"], "partition_type": "row"},
        ]
    return [
        {"patterns": [r"^blocks\.\d+\.0\.weight$", r"^blocks\.\d+\.0\.bias$"], "partition_type": "column"},
        {"patterns": [r"^blocks\.\d+\.2\.weight$"], "partition_type": "row"},
    ]


class TinyLM(nn.Module):
    """Embedding -> residual MLP blocks -> LayerNorm -> (tied) head, plus a frozen projection."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.blocks = nn.ModuleList(
            GluBlock(spec.hidden, spec.ffn)
            if spec.glu
            else nn.Sequential(nn.Linear(spec.hidden, spec.ffn), nn.GELU(), nn.Linear(spec.ffn, spec.hidden))
            for _ in range(spec.layers)
        )
        self.proj = nn.Linear(spec.hidden, spec.hidden) if spec.frozen else None
        if self.proj is not None:
            self.proj.requires_grad_(False)
        self.norm = nn.LayerNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        if spec.tied:
            self.head.weight = self.embed.weight
        if spec.buffers:
            self.register_buffer("calls", torch.zeros(2))
            self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "calls"):
            with torch.no_grad():
                calls: torch.Tensor = self.calls  # type: ignore[assignment]  # a registered buffer
                calls += torch.tensor([1.0, 0.5], dtype=calls.dtype, device=calls.device)
        x = self.embed(tokens[:, :-1])
        for block in self.blocks:
            x = x + block(x)
        if self.proj is not None:
            x = x + 0.1 * self.proj(x)
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def build_param_groups(model: nn.Module, count: int, lr: float) -> list[dict]:
    """Param groups with their own lr and weight_decay, as real training scripts make them."""
    seen: set[int] = set()
    decay, no_decay, embed = [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        if count >= 3 and name.startswith("embed"):
            embed.append(param)
        elif param.ndim >= 2 or count == 1:
            decay.append(param)
        else:
            no_decay.append(param)
    groups = [{"params": decay, "weight_decay": 0.1, "lr": lr}]
    if count >= 2:
        groups.append({"params": no_decay, "weight_decay": 0.0, "lr": lr * 2})
    if count >= 3:
        groups.append({"params": embed, "weight_decay": 0.05, "lr": lr / 2})
    return groups


def batch_for_step(
    step: int, *, seed: int, global_batch: int, seq: int, vocab: int, rank: int, dp: int
) -> torch.Tensor:
    """This rank's slice of the global batch for ``step``: the same global batch at every DP size."""
    gen = torch.Generator().manual_seed(seed * 100003 + step)
    tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=gen)
    micro = global_batch // dp
    return tokens[rank * micro : (rank + 1) * micro]


def spec_batch(spec: Any, step: int, *, rank: int, dp: int) -> torch.Tensor:
    """:func:`batch_for_step` with a run spec's data settings (``data_seed``, ``global_batch``, ``seq``, the
    model's ``vocab``): every harness's runs see the same batches."""
    return batch_for_step(
        step,
        seed=spec.data_seed,
        global_batch=spec.global_batch,
        seq=spec.seq,
        vocab=spec.model.vocab,
        rank=rank,
        dp=dp,
    )
