"""A Megatron-Core GPT checkpoint seen as the Hugging Face Llama it is, and a Llama run (DeepSpeed, FSDP, DCP,
Trainer) seen as the Megatron-Core GPT it would be: names, fused tensors and vocabulary padding mapped
(``ucp.frameworks.megatron_llama``), every optimizer state tensor the same way as its weight, steps and param
groups kept. Targets take these views like any reader (``ucp.targets.registry`` picks them for a target across the
border).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from ucp.errors import InputError
from ucp.frameworks.megatron import FULLY
from ucp.frameworks.megatron_llama import LlamaShape, fuse, hf_parts, megatron_of, split
from ucp.model.layouts import MegatronRun
from ucp.model.records import Facts, GroupMeta, ParamMeta, ParamState, Reader, ReaderView

__all__ = ["MegatronAsLlama", "LlamaAsMegatron", "hf_order"]

#: Hugging Face ``LlamaDecoderLayer``'s parameters in ``named_parameters`` order (a DeepSpeed target's flat groups
#: follow it)
_HF_LAYER = (
    "self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight", "self_attn.k_proj.bias",
    "self_attn.v_proj.weight", "self_attn.v_proj.bias", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
)  # fmt: skip
_HF_TOP = {"model.embed_tokens.weight": 0, "model.norm.weight": 2, "lm_head.weight": 3}


def hf_order(name: str) -> tuple[int, int, int]:
    """Where ``LlamaForCausalLM.named_parameters()`` puts a tensor."""
    if name in _HF_TOP:
        return (_HF_TOP[name], 0, 0)
    layer, _, sub = name[len("model.layers.") :].partition(".")
    return (1, int(layer), _HF_LAYER.index(sub))


def _apply_all(state: ParamState, fn: Any) -> list[ParamState]:
    """One :class:`ParamState` per part: ``fn`` applied to the master and to every state tensor alike."""
    masters = fn(state.fp32)
    optim = {k: fn(v) for k, v in state.optim.items()}
    return [
        ParamState(fp32=m, optim={k: parts[i] for k, parts in optim.items()}, step=state.step, scalars=state.scalars)
        for i, m in enumerate(masters)
    ]


class MegatronAsLlama(ReaderView):
    """A Megatron source's parameters under Hugging Face Llama names, split from the fused ones; see the module
    docstring. The facts no longer carry the Megatron run (a target writes the Llama it is)."""

    def __init__(self, inner: Reader) -> None:
        run = inner.facts.megatron
        if run is None:
            raise InputError("the source is no Megatron-Core checkpoint")
        self.shape = LlamaShape.from_megatron(run.args)
        facts = inner.facts
        metas: list[ParamMeta] = []
        for meta in facts.params:
            for hf, size in zip(hf_parts(meta.name), self._part_shapes(meta), strict=True):
                metas.append(dataclasses.replace(meta, name=hf, shape=size))
        metas.sort(key=lambda m: hf_order(m.name))
        by_name = {m.name: m for m in metas}
        groups = [
            dataclasses.replace(g, params=sorted((h for n in g.params for h in hf_parts(n)), key=hf_order))
            for g in facts.groups
        ]
        order = [by_name[n] for g in groups for n in g.params] + [m for m in metas if m.group is None]
        notes = [
            "not carried out of Megatron: its lr schedule (opt_param_scheduler: Megatron's own, by samples) and its "
            "RNG state"
        ]
        if self.shape.vocab < self.shape.padded_vocab:
            notes.append(
                f"the vocabulary's padding rows {self.shape.vocab}..{self.shape.padded_vocab - 1} of the embedding and "
                f"output layer (Megatron's make_vocab_size_divisible_by), their weights and state, are not carried: the "
                f"Llama has the tokenizer's {self.shape.vocab} (the args' vocab_size)"
            )
        facts = dataclasses.replace(
            facts, params=order, groups=groups, megatron=None, warnings=[*facts.warnings, *notes]
        )
        super().__init__(inner, facts)
        self._lock = threading.Lock()
        self._cached: tuple[str, bool, list[ParamState]] | None = None

    def _part_shapes(self, meta: ParamMeta) -> list[tuple[int, ...]]:
        probe = torch.empty(meta.shape, device="meta")
        return [tuple(p.shape) for p in split(meta.name, probe, self.shape)]

    def reads_whole(self, name: str) -> bool:
        return True

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        megatron, index = megatron_of(name)
        with self._lock:
            cached = self._cached
            if cached is None or cached[0] != megatron or (moments and not cached[1]):
                state = self.inner.read(megatron, moments=moments)
                cached = (megatron, moments, _apply_all(state, lambda t: split(megatron, t, self.shape)))
                self._cached = cached
        return cached[2][index]

    def param_steps(self) -> dict[str, int | None]:
        return {h: step for name, step in self.inner.param_steps().items() for h in hf_parts(name)}


def megatron_run(facts: Facts, shape: LlamaShape) -> MegatronRun:
    """The Megatron-LM run a Llama run would be: its args (``no_save_rng``: there is no Megatron RNG state to load),
    the optimizer's ``fully_reshardable`` state, an lr schedule at the samples consumed (resume with
    ``--override-opt_param-scheduler``: the source's schedule is not Megatron's), ``_extra_state`` as the local layer
    spec keeps it."""
    info = facts.info
    samples = int(info.global_samples or 0)
    lr = max((g.hyper.lr for g in facts.groups), default=0.0)
    args = {
        **shape.megatron_args(),
        "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "data_parallel_size": info.dp_world_size,
        "world_size": info.dp_world_size, "iteration": info.global_steps, "consumed_train_samples": samples,
        "use_distributed_optimizer": True, "ckpt_format": "torch_dist", "dist_ckpt_optim_fully_reshardable": True,
        "no_save_rng": True, "no_save_optim": False, "bf16": info.dtype == "bf16", "fp16": info.dtype == "fp16",
        "params_dtype": {"bf16": torch.bfloat16, "fp16": torch.float16}.get(info.dtype, torch.float32),
    }  # fmt: skip
    schedule = {"max_lr": lr, "lr_warmup_steps": 0, "num_steps": samples, "lr_decay_style": "constant",
                "lr_decay_steps": 1, "min_lr": lr, "start_wd": 0.0, "end_wd": 0.0, "wd_incr_style": "constant",
                "wd_incr_steps": 1}  # fmt: skip
    content = {
        "distrib_optim_sharding_type": FULLY,
        "singleton_local_shards": False,
        "chained_optim_avoid_prefix": True,
    }
    common = {"checkpoint_version": 3.0, "opt_param_scheduler": schedule, "num_floating_point_operations_so_far": 0,
              "content_metadata": content}  # fmt: skip
    layers = shape.layers
    linears = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2")
    objects = {f"decoder.layers.{sub}._extra_state/shard_{layer}_{layers}": [None] for sub in linears
               for layer in range(layers)}  # fmt: skip
    return MegatronRun(args, FULLY, 1, 1, info.dp_world_size, common, objects, {})


class LlamaAsMegatron(ReaderView):
    """A Llama run's parameters as Megatron-Core GPT's, fused from the Hugging Face ones; see the module docstring.
    Every part of a fused tensor must sit in one param group."""

    def __init__(self, inner: Reader, shape: LlamaShape) -> None:
        self.shape = shape
        facts = inner.facts
        have = {m.name: m for m in facts.params}
        self.parts: dict[str, list[str]] = {}
        for meta in facts.params:
            megatron, _ = megatron_of(meta.name)
            self.parts.setdefault(megatron, []).append(meta.name)
        metas: list[ParamMeta] = []
        for megatron, parts in self.parts.items():
            wanted = hf_parts(megatron)
            if sorted(parts) != sorted(wanted):
                raise InputError(f"{megatron} needs {list(wanted)}; the source holds {parts}")
            self.parts[megatron] = list(wanted)
            homes = {have[p].group for p in wanted}
            if len(homes) != 1:
                raise InputError(
                    f"{megatron}'s parts {list(wanted)} are in different param groups {sorted(map(str, homes))}"
                )
            probe = [torch.empty(have[p].shape, device="meta") for p in wanted]
            size = tuple(fuse(megatron, probe, shape).shape)
            metas.append(dataclasses.replace(have[wanted[0]], name=megatron, shape=size))
        groups = [self._group(g) for g in facts.groups]
        facts = dataclasses.replace(facts, params=metas, groups=groups, folder=None)
        facts = dataclasses.replace(facts, megatron=megatron_run(facts, shape))
        super().__init__(inner, facts)

    def _group(self, group: GroupMeta) -> GroupMeta:
        members = list(dict.fromkeys(megatron_of(n)[0] for n in group.params))
        raw = {**group.raw, "wd_mult": 1.0 if group.hyper.weight_decay else 0.0, "lr_mult": 1.0,
               "is_expert_parallel": False, "default_config": True, "is_decoupled_lr": False,
               "max_lr": group.raw.get("initial_lr", group.hyper.lr), "min_lr": group.hyper.lr}  # fmt: skip
        return dataclasses.replace(group, params=members, raw=raw)

    def reads_whole(self, name: str) -> bool:
        return True

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        states = [self.inner.read(part, moments=moments) for part in self.parts[name]]
        first = states[0]
        keys = first.optim.keys()
        return ParamState(
            fp32=fuse(name, [s.fp32 for s in states], self.shape),
            optim={k: fuse(name, [s.optim[k] for s in states], self.shape) for k in keys},
            step=first.step,
            scalars=first.scalars,
        )

    def param_steps(self) -> dict[str, int | None]:
        steps = self.inner.param_steps()
        return {m: steps.get(parts[0]) for m, parts in self.parts.items()}
