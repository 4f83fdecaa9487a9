"""How a Llama-family model is laid out in Megatron-Core's GPT and in Hugging Face's ``LlamaForCausalLM`` (and so
in a DeepSpeed or FSDP run of it): the names, the fused tensors, the config.

Megatron fuses attention's Q, K and V into ``linear_qkv`` with the query groups interleaved: for each of the
``groups`` KV heads, its ``heads / groups`` query heads, then its key head, then its value head (``head_dim`` rows
each); and SwiGLU's gate and up projections into ``linear_fc1`` (gate rows, then up rows). The norms before
attention and MLP are stored as the ``layer_norm_weight`` of the next linear, the vocabulary padded to a multiple of
``make_vocab_size_divisible_by`` x TP. Every optimizer state tensor is elementwise, so the same split and fuse apply
to it as to the weight.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ucp.errors import InputError

__all__ = ["LlamaShape", "LAYER_MAP", "TOP_MAP", "hf_parts", "split", "fuse", "megatron_of"]

#: a Megatron layer's tensor (checkpoint sub-key) -> its Hugging Face tensors in that layer
LAYER_MAP: dict[str, tuple[str, ...]] = {
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight",),
    "self_attention.linear_qkv.weight": (
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ),
    "self_attention.linear_qkv.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight",),
    "mlp.linear_fc1.layer_norm_weight": ("post_attention_layernorm.weight",),
    "mlp.linear_fc1.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "mlp.linear_fc2.weight": ("mlp.down_proj.weight",),
}
#: Megatron tensors outside the layers -> Hugging Face's
TOP_MAP: dict[str, str] = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_VOCAB = frozenset({"embedding.word_embeddings.weight", "output_layer.weight"})


@dataclass(frozen=True)
class LlamaShape:
    """The sizes that fix both layouts, read from Megatron-LM's args or a Hugging Face config."""

    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    vocab: int
    padded_vocab: int
    tied: bool
    eps: float = 1e-5
    rope_theta: float = 10000.0
    max_positions: int = 4096

    @classmethod
    def from_megatron(cls, args: Mapping[str, Any], vocab: int | None = None) -> LlamaShape:
        """From Megatron-LM's args; the model must be Llama-like (RMSNorm, SwiGLU, RoPE, no biases but QKV's)."""
        odd = {
            k: args.get(k)
            for k, want in (("normalization", "RMSNorm"), ("swiglu", True), ("position_embedding_type", "rope"))
            if args.get(k) != want
        }
        if odd:
            raise InputError(
                f"the Megatron run is no Llama-family model ({odd}); ucp maps RMSNorm + SwiGLU + RoPE models"
            )
        heads = int(args["num_attention_heads"])
        hidden = int(args["hidden_size"])
        padded = int(args.get("padded_vocab_size") or 0)
        return cls(
            layers=int(args["num_layers"]),
            hidden=hidden,
            heads=heads,
            groups=int(args.get("num_query_groups") or heads) if args.get("group_query_attention", True) else heads,
            head_dim=int(args.get("kv_channels") or hidden // heads),
            ffn=int(args["ffn_hidden_size"]),
            # Megatron-LM's args hold the tokenizer's size as vocab_size when it was given (and ucp writes it)
            vocab=vocab or _given_vocab(args) or padded,
            padded_vocab=padded,
            tied=not bool(args.get("untie_embeddings_and_output_weights", False)),
            eps=float(args.get("norm_epsilon") or 1e-5),
            rope_theta=float(args.get("rotary_base") or 10000.0),
            max_positions=int(args.get("max_position_embeddings") or args.get("seq_length") or 4096),
        )

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], pad_to: int = 1) -> LlamaShape:
        """From a Hugging Face ``config.json`` of a Llama-family model (``LlamaForCausalLM`` and kin), the vocabulary
        padded to a multiple of ``pad_to`` for Megatron."""
        if config.get("hidden_act", "silu") != "silu":
            raise InputError(f"hidden_act {config.get('hidden_act')!r}: ucp maps SwiGLU (silu) Llama-family models")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        vocab = int(config["vocab_size"])
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=hidden,
            heads=heads,
            groups=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            ffn=int(config["intermediate_size"]),
            vocab=vocab,
            padded_vocab=-(-vocab // pad_to) * pad_to,
            tied=bool(config.get("tie_word_embeddings", False)),
            eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            max_positions=int(config.get("max_position_embeddings", 4096)),
        )

    def megatron_args(self) -> dict[str, Any]:
        """The model's fields of Megatron-LM's args, as its ``check_checkpoint_args`` and the model builder read them."""
        return {
            "num_layers": self.layers, "hidden_size": self.hidden, "ffn_hidden_size": self.ffn,
            "num_attention_heads": self.heads, "num_query_groups": self.groups,
            "group_query_attention": self.groups != self.heads, "kv_channels": self.head_dim,
            "padded_vocab_size": self.padded_vocab, "vocab_size": self.vocab, "normalization": "RMSNorm", "norm_epsilon": self.eps,
            "swiglu": True, "position_embedding_type": "rope", "rotary_base": self.rope_theta,
            "add_bias_linear": False, "untie_embeddings_and_output_weights": not self.tied,
            "max_position_embeddings": self.max_positions,
        }  # fmt: skip

    def hf_config(self) -> dict[str, Any]:
        """A ``config.json`` that ``LlamaForCausalLM.from_pretrained`` builds the same model from."""
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden,
            "intermediate_size": self.ffn, "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.groups, "head_dim": self.head_dim, "vocab_size": self.vocab,
            "rms_norm_eps": self.eps, "rope_theta": self.rope_theta, "hidden_act": "silu",
            "max_position_embeddings": self.max_positions, "tie_word_embeddings": self.tied,
            "attention_bias": False, "mlp_bias": False,
        }  # fmt: skip

    def part_rows(self, sub: str) -> list[int]:
        """Rows of each Hugging Face part of a fused layer tensor, in :data:`LAYER_MAP` order."""
        if sub.startswith("self_attention.linear_qkv.") and not sub.endswith("layer_norm_weight"):
            return [self.heads * self.head_dim, self.groups * self.head_dim, self.groups * self.head_dim]
        if sub == "mlp.linear_fc1.weight":
            return [self.ffn, self.ffn]
        return []


def _given_vocab(args: Mapping[str, Any]) -> int | None:
    value = args.get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def hf_parts(name: str) -> tuple[str, ...]:
    """The Hugging Face names of a Megatron parameter (``decoder.layers.<l>.<sub>`` or a top-level one)."""
    if name in TOP_MAP:
        return (TOP_MAP[name],)
    prefix = "decoder.layers."
    layer, _, sub = name[len(prefix) :].partition(".") if name.startswith(prefix) else ("", "", "")
    if not layer.isdigit() or sub not in LAYER_MAP:
        raise InputError(f"{name} has no Hugging Face Llama counterpart ucp knows")
    return tuple(f"model.layers.{layer}.{part}" for part in LAYER_MAP[sub])


def megatron_of(hf: str) -> tuple[str, int]:
    """The Megatron parameter a Hugging Face tensor is part of, and which part."""
    for megatron, name in TOP_MAP.items():
        if hf == name:
            return megatron, 0
    prefix = "model.layers."
    layer, _, sub = hf[len(prefix) :].partition(".") if hf.startswith(prefix) else ("", "", "")
    for msub, parts in LAYER_MAP.items():
        if layer.isdigit() and sub in parts:
            return f"decoder.layers.{layer}.{msub}", parts.index(sub)
    raise InputError(f"{hf} has no Megatron GPT counterpart ucp knows (a Llama-family model's tensors only)")


def _qkv_view(tensor: torch.Tensor, shape: LlamaShape) -> torch.Tensor:
    per = shape.heads // shape.groups
    return tensor.reshape(shape.groups, per + 2, shape.head_dim, *tensor.shape[1:])


def split(name: str, tensor: torch.Tensor, shape: LlamaShape) -> list[torch.Tensor]:
    """A Megatron tensor (a weight or any elementwise state of it) as its Hugging Face parts."""
    sub = name.split(".", 3)[3] if name.startswith("decoder.layers.") else ""
    if name in _VOCAB:
        return [tensor[: shape.vocab]]
    if sub.startswith("self_attention.linear_qkv.") and not sub.endswith("layer_norm_weight"):
        per = shape.heads // shape.groups
        grouped = _qkv_view(tensor, shape)
        rest = tensor.shape[1:]
        q = grouped[:, :per].reshape(shape.heads * shape.head_dim, *rest)
        k = grouped[:, per].reshape(shape.groups * shape.head_dim, *rest)
        v = grouped[:, per + 1].reshape(shape.groups * shape.head_dim, *rest)
        return [q.clone(), k.clone(), v.clone()]
    if sub == "mlp.linear_fc1.weight":
        return [tensor[: shape.ffn].clone(), tensor[shape.ffn :].clone()]
    return [tensor]


def fuse(name: str, parts: Sequence[torch.Tensor], shape: LlamaShape) -> torch.Tensor:
    """The Megatron tensor made of its Hugging Face parts (the inverse of :func:`split`; padded vocabulary rows are
    zeros)."""
    sub = name.split(".", 3)[3] if name.startswith("decoder.layers.") else ""
    if name in _VOCAB:
        (part,) = parts
        out = torch.zeros((shape.padded_vocab, *part.shape[1:]), dtype=part.dtype, device=part.device)
        out[: shape.vocab] = part
        return out
    if sub.startswith("self_attention.linear_qkv.") and not sub.endswith("layer_norm_weight"):
        q, k, v = parts
        per = shape.heads // shape.groups
        rest = q.shape[1:]
        grouped = torch.cat(
            [
                q.reshape(shape.groups, per, shape.head_dim, *rest),
                k.reshape(shape.groups, 1, shape.head_dim, *rest),
                v.reshape(shape.groups, 1, shape.head_dim, *rest),
            ],
            dim=1,
        )
        return grouped.reshape(-1, *rest)
    if sub == "mlp.linear_fc1.weight":
        return torch.cat(list(parts), dim=0)
    (part,) = parts
    return part
