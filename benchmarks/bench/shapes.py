"""What a synthetic benchmark checkpoint holds: parameter names and shapes in param groups, and its ZeRO layout.

Pure Python (no torch): the series runner sizes its points from here without importing anything heavy, and the
builder (``benchmarks/synth_checkpoint.py``) writes exactly what these records describe. The layout facts are
DeepSpeed 0.19.8's, as docs/format.md states them:

- ZeRO-3: every parameter is cut on its own into ``dp`` partitions of ``ceil(numel / dp)`` elements (the last one
  zero-padded), and each rank concatenates its partitions in param-group order into one flat fp32 buffer per
  sub-group. The builder writes one sub-group per param group, which is what DeepSpeed does while a group's
  partition stays under ``sub_group_size`` (default 1e9 elements): :func:`check_spec` refuses a model where it would
  not.
- ZeRO-1/2: a param group's parameters are laid end to end in one flat buffer (no gaps without
  ``parameter_alignment``, in group order without ``round_robin_gradients``), zero-padded to a multiple of
  ``2 x dp`` elements and cut into ``dp`` equal partitions; a parameter can straddle ranks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's zero_optimization.sub_group_size default
ZERO12_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: a ZeRO-1/2 flat group pads to a multiple of 2 x dp
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class SynthSpec:
    """One synthetic checkpoint: the model's param groups, the ZeRO stage, dtype and DP size, the values' seed."""

    groups: list[list[Param]]
    dp: int
    dtype: str = "bf16"  # bf16 | fp32: names the files (bf16_ prefix) and the model's weights / placeholders
    stage: int = 3  # 1 | 2 | 3
    step: int = 1  # the optimizer step and global_steps recorded
    seed: int = 0
    label: str = ""

    @property
    def params(self) -> list[Param]:
        return [p for group in self.groups for p in group]

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    def partition(self, param: Param) -> int:
        """Elements each rank holds of ``param`` at ZeRO-3, padding included."""
        return -(-param.numel // self.dp)

    def group_numel(self, group: int) -> int:
        return sum(p.numel for p in self.groups[group])

    def group_partition(self, group: int) -> int:
        """Elements of one rank's flat buffer for param group ``group``, padding included."""
        if self.stage == 3:
            return sum(self.partition(p) for p in self.groups[group])
        unit = ZERO12_ALIGNMENT * self.dp
        return -(-self.group_numel(group) // unit) * unit // self.dp

    def group_padding(self, group: int, rank: int) -> int:
        """ZeRO-1/2: padding elements at the end of ``rank``'s partition of ``group`` (``group_paddings``)."""
        size, numel = self.group_partition(group), self.group_numel(group)
        return min(size, max(0, (rank + 1) * size - numel))

    def shard_bytes(self) -> int:
        """Bytes of tensor data in the optim files (fp32 master, exp_avg, exp_avg_sq), padding included."""
        return 4 * (1 + len(ADAM_KEYS)) * self.dp * sum(self.group_partition(g) for g in range(len(self.groups)))

    def files(self) -> int:
        """Rank files: per rank an optim-states file, and a model-states file per rank (ZeRO-3) or one (ZeRO-1/2)."""
        return 2 * self.dp if self.stage == 3 else self.dp + 1

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["groups"] = [[[p.name, list(p.shape)] for p in group] for group in self.groups]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SynthSpec:
        data = dict(data)
        groups = [[Param(name, tuple(shape)) for name, shape in group] for group in data.pop("groups")]
        return cls(groups=groups, **data)


def check_spec(spec: SynthSpec, sub_group_size: int = DEFAULT_SUB_GROUP_SIZE) -> None:
    """Refuse a stage the builder does not write, and a ZeRO-3 spec whose group partition DeepSpeed would split
    into several sub-groups (not written here)."""
    if spec.stage not in (1, 2, 3):
        raise ValueError(f"the builder writes ZeRO-1, 2 and 3 checkpoints, not stage {spec.stage}")
    if spec.stage != 3:
        return
    for g in range(len(spec.groups)):
        if spec.group_partition(g) > sub_group_size:
            raise ValueError(
                f"param group {g} holds {spec.group_partition(g)} elements per rank at DP {spec.dp}, over "
                f"sub_group_size {sub_group_size}: raise the DP size"
            )


def _decay_split(params: list[Param]) -> list[list[Param]]:
    """Two groups as training scripts make them: matrices with weight decay, vectors without."""
    return [[p for p in params if len(p.shape) >= 2], [p for p in params if len(p.shape) < 2]]


def tiny_lm(vocab: int, hidden: int, ffn: int, layers: int) -> list[list[Param]]:
    """ucp.harness's TinyLM untied, with no frozen projection and no buffers, in its named_parameters order."""
    params = [Param("embed.weight", (vocab, hidden))]
    for i in range(layers):
        params += [
            Param(f"blocks.{i}.0.weight", (ffn, hidden)),
            Param(f"blocks.{i}.0.bias", (ffn,)),
            Param(f"blocks.{i}.2.weight", (hidden, ffn)),
            Param(f"blocks.{i}.2.bias", (hidden,)),
        ]
    params += [Param("norm.weight", (hidden,)), Param("norm.bias", (hidden,)), Param("head.weight", (vocab, hidden))]
    return _decay_split(params)


def llama_layers(layers: int, hidden: int = 8192, ffn: int = 28672, kv: int = 1024) -> list[Param]:
    """Decoder layers with Llama-3's parameter shapes (defaults: Llama-3-70B, GQA with 8 KV heads of 128)."""
    out: list[Param] = []
    for i in range(layers):
        pre = f"model.layers.{i}"
        out += [
            Param(f"{pre}.input_layernorm.weight", (hidden,)),
            Param(f"{pre}.self_attn.q_proj.weight", (hidden, hidden)),
            Param(f"{pre}.self_attn.k_proj.weight", (kv, hidden)),
            Param(f"{pre}.self_attn.v_proj.weight", (kv, hidden)),
            Param(f"{pre}.self_attn.o_proj.weight", (hidden, hidden)),
            Param(f"{pre}.post_attention_layernorm.weight", (hidden,)),
            Param(f"{pre}.mlp.gate_proj.weight", (ffn, hidden)),
            Param(f"{pre}.mlp.up_proj.weight", (ffn, hidden)),
            Param(f"{pre}.mlp.down_proj.weight", (hidden, ffn)),
        ]
    return out


def llama_model(layers: int, hidden: int, ffn: int, kv: int, vocab: int) -> list[list[Param]]:
    """A whole Llama-shaped model: embedding, ``layers`` decoder layers, final norm and an untied head."""
    params = [Param("model.embed_tokens.weight", (vocab, hidden)), *llama_layers(layers, hidden, ffn, kv)]
    params += [Param("model.norm.weight", (hidden,)), Param("lm_head.weight", (vocab, hidden))]
    return _decay_split(params)


def many_tensors(count: int, total_numel: int) -> list[list[Param]]:
    """``count`` matrices of about equal size summing to about ``total_numel``: a MoE's expert count, shrunk."""
    cols = 64
    rows = max(1, round(total_numel / count / cols))
    return [[Param(f"experts.{i}.weight", (rows, cols)) for i in range(count)]]


def one_tensor(rows: int, cols: int) -> list[list[Param]]:
    """A single matrix, e.g. Llama-3's 128256 x 8192 embedding."""
    return [[Param("embed_tokens.weight", (rows, cols))]]


def layers_for_bytes(total_bytes: int, hidden: int = 1024, ffn: int = 4096, vocab: int = 32000) -> list[list[Param]]:
    """A Llama-shaped model (small dims) grown by layer count until its ZeRO-3 Adam shards hold ``total_bytes``."""
    fixed = 2 * vocab * hidden + hidden
    per_layer = 2 * hidden * hidden + 2 * (hidden // 8) * hidden + 3 * hidden * ffn + 2 * hidden
    layers = max(1, round((total_bytes / 12 - fixed) / per_layer))
    return llama_model(layers, hidden, ffn, hidden // 8, vocab)


@dataclass
class Projection:
    """A real model's ZeRO-3 bf16 Adam checkpoint, counted (never built): what the cost model is applied to."""

    label: str
    params: int
    tensors: int
    dp: int
    shard_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.shard_bytes = 12 * self.params  # fp32 master + exp_avg + exp_avg_sq per parameter


def llama_projection(label: str, layers: int, hidden: int, ffn: int, kv: int, vocab: int, dp: int) -> Projection:
    params = [p for g in llama_model(layers, hidden, ffn, kv, vocab) for p in g]
    return Projection(label, sum(p.numel for p in params), len(params), dp)


PROJECTIONS = (
    llama_projection("Llama-3-70B, DP 512", 80, 8192, 28672, 1024, 128256, 512),
    llama_projection("Llama-3-405B, DP 1024", 126, 16384, 53248, 1024, 128256, 1024),
)
