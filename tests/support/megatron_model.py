"""The tiny Llama-like Megatron-Core GPT of the Megatron harness, its DDP + DistributedOptimizer, data and steps.

RMSNorm, SwiGLU, RoPE, GQA, untied embeddings, no biases, fp32, Megatron's local (non-Transformer-Engine)
layer spec. ``use_cpu_initialization`` draws each full weight and slices it per TP rank, so the initial weights
and the loss curve are the same at every TP and DP (PP builds its layers in another order: other weights).
Imported by the ranks only (it imports megatron lazily, after :func:`tests.support.megatron_cpu.patch_for_cpu`).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["DEFAULT", "ODD", "Built", "build", "forward_backward", "global_batch", "init_parallel", "train_step"]

#: the model: 2 layers, hidden 64, SwiGLU ffn 128 per branch, 4 heads in 2 query groups of head dim 16, vocab 128.
#: ``rotary_base`` and ``layernorm_epsilon`` are Megatron's defaults, spelled out for the HF Llama twin.
DEFAULT: dict[str, Any] = dict(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    vocab_size=128,
    seq_length=16,
    rotary_base=10000,
    layernorm_epsilon=1e-5,
)
#: ``MegatronSpec.odd``: sizes that are no multiple of 64, so the optimizer's buffers pad inside and params
#: straddle DP shards
ODD: dict[str, Any] = dict(DEFAULT, hidden_size=40, ffn_hidden_size=72, kv_channels=10, vocab_size=96)


class Built:
    """A rank's model (its DDP wrapper), optimizer, scheduler and TransformerConfig."""

    def __init__(self, config: Any, ddp: Any, optimizer: Any, scheduler: Any) -> None:
        self.config, self.ddp, self.optimizer, self.scheduler = config, ddp, optimizer, scheduler

    @property
    def distributed(self) -> Any:
        """The DistributedOptimizer inside Megatron's ChainedOptimizer (one: no experts)."""
        return getattr(self.optimizer, "chained_optimizers", [self.optimizer])[0]


#: The harness's distributed Adam: its OptimizerConfig, and the same values in the args its checkpoints record
ADAM: dict[str, Any] = dict(
    optimizer="adam",
    weight_decay=0.01,
    adam_beta1=0.9,
    adam_beta2=0.95,
    adam_eps=1e-8,
    clip_grad=1.0,
    bf16=False,
    fp16=False,
    params_dtype=torch.float32,
    use_distributed_optimizer=True,
)


def init_parallel(tp: int, pp: int, seed: int) -> None:
    """gloo, Megatron's model-parallel groups, and Megatron-LM's ``_set_random_seed`` (seed + 100 * pp_rank
    for python/numpy/torch and the tracker); then the default generator at ``seed`` on every rank, so the CPU
    initialisation draws the same full weights everywhere."""
    from megatron.core import parallel_state, tensor_parallel

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tensor_parallel.model_parallel_cuda_manual_seed(stage_seed)
    torch.manual_seed(seed)


def _transformer_config(model: dict[str, Any], tp: int, pp: int) -> Any:
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=model["num_layers"],
        hidden_size=model["hidden_size"],
        ffn_hidden_size=model["ffn_hidden_size"],
        num_attention_heads=model["num_attention_heads"],
        num_query_groups=model["num_query_groups"],
        kv_channels=model["kv_channels"],
        layernorm_epsilon=model["layernorm_epsilon"],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        # no fused kernels on CPU (they are CUDA or Apex ones); none changes the parameters or the layout
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        sequence_parallel=False,
    )


def build(model: dict[str, Any], tp: int, pp: int, seed: int, bucket_size: int | None, lr: float = 1e-2) -> Built:
    """GPTModel + DDP (fp32 grads, distributed optimizer) + Adam (wd 0.01, clip 1.0) + a constant-lr scheduler,
    wired the way Megatron-LM's ``setup_model_and_optimizer`` and ``train`` wire them. ``bucket_size`` turns on
    ``overlap_grad_reduce`` so the buffer splits into buckets (Megatron-LM's default: one bucket)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = _transformer_config(model, tp, pp)
    torch.manual_seed(seed)  # the same full CPU initialisation on every rank and layout
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=model["vocab_size"],
        max_sequence_length=model["seq_length"],
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        rotary_base=model["rotary_base"],
    )
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=bucket_size is not None,
        use_distributed_optimizer=True,
        bucket_size=bucket_size,
    )
    ddp = DistributedDataParallel(config, ddp_config, gpt)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=lr, min_lr=lr, **ADAM),
        [ddp],
    )
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=lr,
        max_lr=lr,
        min_lr=lr,
        lr_warmup_steps=0,
        lr_decay_steps=1000,
        lr_decay_style="constant",
        start_wd=0.01,
        end_wd=0.01,
        wd_incr_steps=1000,
        wd_incr_style="constant",
    )
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return Built(config, ddp, optimizer, scheduler)


def global_batch(step: int, seed: int, rows: int, model: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s global batch (tokens, next tokens), the same at every layout: learnable arithmetic
    sequences."""
    gen = torch.Generator().manual_seed(seed * 1000 + step)
    vocab, seq = model["vocab_size"], model["seq_length"]
    start = torch.randint(0, vocab, (rows, 1), generator=gen)
    stride = torch.randint(1, 4, (rows, 1), generator=gen)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def forward_backward(built: Built, tokens: torch.Tensor, labels: torch.Tensor, micro: int) -> float | None:
    """One forward and backward of the global batch (tokens, labels) through Megatron's pipeline schedule: rows
    split over DP, ``micro`` rows per micro-batch. Returns the batch's mean token loss on every rank (the DP
    mean of each rank's micro-batch mean), leaves the gradients in the DDP buffers (reduce-scattered over DP)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per = tokens.shape[0] // dp
    tokens, labels = tokens[dp_rank * per : (dp_rank + 1) * per], labels[dp_rank * per : (dp_rank + 1) * per]
    batches = [(tokens[i : i + micro], labels[i : i + micro]) for i in range(0, per, micro)]
    seq = tokens.shape[1]

    def loss_func(mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = (output.float() * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}  # clone: the schedule divides the loss in place

    def forward_step(data: Any, model: Any) -> tuple[torch.Tensor, Any]:
        batch_tokens, batch_labels = next(data)
        positions = torch.arange(seq).unsqueeze(0).expand_as(batch_tokens)
        output = model(batch_tokens, positions, None, labels=batch_labels)
        return output, lambda out: loss_func(torch.ones_like(batch_labels, dtype=torch.float), out)

    built.ddp.zero_grad_buffer()
    built.optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[built.ddp],
        num_microbatches=len(batches),
        seq_length=seq,
        micro_batch_size=micro,
        forward_only=False,
    )
    loss = torch.zeros(1)
    if parallel_state.is_pipeline_last_stage():
        loss[0] = torch.stack([x["lm loss"] for x in losses]).mean()
        torch.distributed.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss /= dp
    world = torch.distributed.get_world_size()
    torch.distributed.broadcast(loss, src=world - 1)  # the last rank is on the last pipeline stage
    return float(loss[0])


def train_step(built: Built, step: int, seed: int, rows: int, micro: int, model: dict[str, Any]) -> dict[str, Any]:
    """Optimizer step ``step`` (0-based) on its global batch: loss, grad norm, whether the step was taken."""
    tokens, labels = global_batch(step, seed, rows, model)
    loss = forward_backward(built, tokens, labels, micro)
    ok, grad_norm, _ = built.optimizer.step()
    built.scheduler.step(increment=rows)
    return {"loss": loss, "grad_norm": float(grad_norm) if grad_norm is not None else None, "ok": bool(ok)}
