"""The harness's Megatron GPT as a Hugging Face ``LlamaForCausalLM``: the config, and the weight mapping both ways.

This is the *reference* for the mapping ucp implements (tests only). tests/test_megatron_harness.py proves it
numerically: the Megatron GPT and this Llama with mapped weights give the same loss on the same tokens (fp32).

What had to match (Megatron-Core 0.16.1 defaults on one side, LlamaConfig fields on the other):
  * RoPE: Megatron's non-interleaved rotary (``rotary_interleaved=False``: rotate-half, the halves of each head
    dim paired) over the whole head dim (``rotary_percent=1.0``) = HF's default rope; base ``rotary_base``
    10000 = ``rope_theta`` 10000 (``rope_type='default'``, no scaling).
  * RMSNorm epsilon: Megatron's ``layernorm_epsilon`` default 1e-5, HF's ``rms_norm_eps`` default 1e-6: set.
  * Attention scale 1/sqrt(kv_channels) (``apply_query_key_layer_scaling=False``; softmax in fp32 anyway) = HF's
    ``head_dim ** -0.5``: ``head_dim=kv_channels`` given explicitly (it need not be hidden / heads).
  * GQA: Megatron query group g serves query heads g*nh/ng .. (g+1)*nh/ng-1 = HF's ``repeat_kv`` order.
  * The causal mask: Megatron fills masked scores with -10000.0, HF with the dtype's min; both give exp() = 0.
  * SwiGLU: Megatron ``silu(x W_fc1[:F]^T) * (x W_fc1[F:]^T)`` = HF ``act(gate(x)) * up(x)``, ``hidden_act='silu'``.
  * No biases anywhere, untied embeddings, no embedding scaling, dropout 0; labels: Megatron takes the next
    tokens as given, HF's ``labels=`` would shift them itself, so the loss here is the mean token
    cross-entropy of the logits against the given labels.

Weights (Megatron record names, TP-invariant layout -> HF names):
  ``embedding.word_embeddings.weight`` -> ``model.embed_tokens.weight``; ``output_layer.weight`` ->
  ``lm_head.weight``; ``decoder.final_layernorm.weight`` -> ``model.norm.weight``; per layer i:
  ``input_layernorm`` -> ``input_layernorm``, ``pre_mlp_layernorm`` -> ``post_attention_layernorm``,
  ``self_attention.linear_proj`` -> ``self_attn.o_proj``, ``mlp.linear_fc2`` -> ``mlp.down_proj``,
  ``mlp.linear_fc1`` rows ``[gate; up]`` -> ``mlp.gate_proj``, ``mlp.up_proj``, and
  ``self_attention.linear_qkv`` rows, per query group g: ``[q heads of g (nh/ng * hn rows), k_g (hn), v_g
  (hn)]`` -> ``self_attn.q_proj`` (the q blocks in order), ``k_proj``, ``v_proj``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["hf_config", "hf_from_megatron", "hf_loss", "megatron_from_hf"]

_LAYER = {  # Megatron per-layer name -> HF per-layer name, for the tensors that map one to one
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


def hf_config(model: dict[str, Any]) -> Any:
    """The LlamaConfig of the harness's model (tests/support/megatron_model.py DEFAULT / ODD)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=model["vocab_size"],
        hidden_size=model["hidden_size"],
        intermediate_size=model["ffn_hidden_size"],
        num_hidden_layers=model["num_layers"],
        num_attention_heads=model["num_attention_heads"],
        num_key_value_heads=model["num_query_groups"],
        head_dim=model["kv_channels"],
        hidden_act="silu",
        max_position_embeddings=model["seq_length"],
        rms_norm_eps=model["layernorm_epsilon"],
        rope_parameters={"rope_type": "default", "rope_theta": float(model["rotary_base"])},
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )


def _qkv_view(model: dict[str, Any], qkv: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    heads, groups, dim = model["num_attention_heads"], model["num_query_groups"], model["kv_channels"]
    per = heads // groups
    return qkv.view(groups, per + 2, dim, qkv.shape[-1]), heads, groups, per


def hf_from_megatron(state: dict[str, torch.Tensor], model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """{Megatron name: full tensor} -> {HF Llama name: tensor} (see the module's docstring)."""
    out = {hf: state[name] for name, hf in _TOP.items()}
    ffn = model["ffn_hidden_size"]
    for i in range(model["num_layers"]):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for name, hf in _LAYER.items():
            out[dst + hf] = state[src + name]
        grouped, heads, groups, per = _qkv_view(model, state[src + "self_attention.linear_qkv.weight"])
        hidden = grouped.shape[-1]
        out[dst + "self_attn.q_proj.weight"] = grouped[:, :per].reshape(heads * model["kv_channels"], hidden)
        out[dst + "self_attn.k_proj.weight"] = grouped[:, per].reshape(groups * model["kv_channels"], hidden)
        out[dst + "self_attn.v_proj.weight"] = grouped[:, per + 1].reshape(groups * model["kv_channels"], hidden)
        fc1 = state[src + "mlp.linear_fc1.weight"]
        out[dst + "mlp.gate_proj.weight"], out[dst + "mlp.up_proj.weight"] = fc1[:ffn], fc1[ffn:]
    return {name: tensor.contiguous() for name, tensor in out.items()}


def megatron_from_hf(hf: dict[str, torch.Tensor], model: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`hf_from_megatron`."""
    out = {name: hf[name_hf] for name, name_hf in _TOP.items()}
    heads, groups, dim = model["num_attention_heads"], model["num_query_groups"], model["kv_channels"]
    for i in range(model["num_layers"]):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for name, name_hf in _LAYER.items():
            out[dst + name] = hf[src + name_hf]
        hidden = hf[src + "self_attn.q_proj.weight"].shape[-1]
        q = hf[src + "self_attn.q_proj.weight"].view(groups, heads // groups, dim, hidden)
        k = hf[src + "self_attn.k_proj.weight"].view(groups, 1, dim, hidden)
        v = hf[src + "self_attn.v_proj.weight"].view(groups, 1, dim, hidden)
        out[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, hidden)
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]]
        )
    return {name: tensor.contiguous() for name, tensor in out.items()}


def hf_loss(
    model: dict[str, Any], weights: dict[str, torch.Tensor], tokens: torch.Tensor, labels: torch.Tensor
) -> tuple[float, dict[str, torch.Tensor]]:
    """The HF Llama's mean token loss of (tokens, labels) with ``weights`` (HF names), fp32, eager attention;
    and the gradients by HF name."""
    from transformers import LlamaForCausalLM

    llama = LlamaForCausalLM._from_config(hf_config(model), attn_implementation="eager", dtype=torch.float32)
    missing, unexpected = llama.load_state_dict(weights, strict=False)
    assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
    llama.train()
    logits = llama(input_ids=tokens).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return float(loss.detach()), {name: p.grad.detach().clone() for name, p in llama.named_parameters()}
