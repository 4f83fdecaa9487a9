"""One rank of a real Hugging Face Trainer run with DeepSpeed, or with FSDP, on CPU.

Started by :func:`tests.support.hf_runs.run_hf` once per rank with RANK/WORLD_SIZE/... set; the
spec arrives as JSON on the command line. Rank 0 writes what the live engine holds right after the
checkpoint load (fp32 masters and Adam moments, gathered with DeepSpeed's own ``safe_get_full_*``)
and after training (global step, every optimizer step, the losses); every rank writes the CPU RNG
state Trainer loaded for it.

With ``spec.extra["fsdp"]`` (see :mod:`tests.support.fsdp_worker`) the run is Trainer's FSDP1/FSDP2 in
fp32 instead, with the same model, data, batch, optimizer and schedule; its records have the same
fields (gathered by clean parameter name with torch's full state dicts, plus ``backend``), and rank 0
also writes ``saved_<step>.pt``: the live state right after each checkpoint save.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ucp.harness.launch import end_rank

__all__ = ["HfSpec", "main"]


@dataclass
class HfSpec:
    """One Trainer run; every field travels to the ranks as JSON.

    ``extra["fsdp"]`` (e.g. ``{"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}``, see
    :mod:`tests.support.fsdp_worker`) makes it an FSDP run (``stage`` and ``sub_group_size`` then unused);
    absent, it is a DeepSpeed run. Living in ``extra``, it leaves the cache keys of DeepSpeed runs alone.
    """

    world: int = 2
    stage: int = 3
    out: str = ""  # Trainer output_dir (checkpoint-N folders appear here)
    record: str = ""  # folder for this run's records
    per_device: int = 2
    accum: int = 3
    max_steps: int = 7
    save_steps: int = 4
    resume: str | None = None  # a checkpoint folder to resume from
    live_from: str | None = None  # ucp.integrations.hf: load any checkpoint at any world size
    sub_group_size: int = 200
    samples: int = 96
    seed: int = 42
    port: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def tiny_llama() -> torch.nn.Module:
    """A two-layer Llama built from its config: no download, odd sizes so every partition pads."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=61,
        hidden_size=16,
        intermediate_size=27,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _model(spec: HfSpec) -> torch.nn.Module:
    """The tiny Llama, or with ``spec.extra["lora"]`` (LoraConfig's fields) a PEFT LoRA model of it: the
    base weights frozen, Trainer saving the DeepSpeed checkpoint with exclude_frozen_parameters=True."""
    model = tiny_llama()
    lora = spec.extra.get("lora")
    if lora is None:
        return model
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **lora))


class _Tokens(torch.utils.data.Dataset):
    """Fixed random token rows; labels are the inputs (causal LM)."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.rows = torch.randint(0, 61, (n, 12), generator=gen)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.rows[i], "labels": self.rows[i]}


def ds_config(spec: HfSpec) -> dict[str, Any]:
    """No optimizer block: Trainer builds torch AdamW with a decay and a no-decay group; top-level
    blocks in ``spec.extra["ds_config"]`` (an optimizer, ``checkpoint.load_universal``) are added, and
    ``spec.extra["zero"]`` entries (``offload_optimizer``) join the zero_optimization block."""
    zero: dict[str, Any] = {"stage": spec.stage, **spec.extra.get("zero", {})}
    if spec.stage == 3:
        zero["sub_group_size"] = spec.sub_group_size
    return dict(spec.extra.get("ds_config") or {}) | {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": zero,
    }


def _engine_state(engine: Any) -> dict[str, Any]:
    """fp32 master and optimizer state of every trained parameter, gathered (collective: every rank calls)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from ucp.harness.worker import _relink_optimizer_state, _stage0_state

    _relink_optimizer_state(engine.optimizer)  # DeepSpeed 0.19.8 ZeRO-1/2 links group 1's fragments too early
    state: dict[str, Any] = {}
    stepped = any(_optimizer_steps(engine))  # before the first step there are no moments (ZeRO-2 keeps step 0)
    inner = engine.optimizer.optimizer.state.values()
    # every elementwise state key the optimizer keeps (AdamW's moments; Adafactor's exp_avg_sq)
    keys = sorted({k for s in inner for k, v in s.items() if torch.is_tensor(v) and v.dim()}) if stepped else []
    for name, param in engine.module.named_parameters():
        if not param.requires_grad:
            continue
        if engine.zero_optimization_stage() == 0:  # no ZeRO: no fragment mapping to gather through
            fp32, moments = _stage0_state(engine, param, keys)
            entry = {"fp32": fp32, **moments}
        else:
            entry = {"fp32": safe_get_full_fp32_param(param)}
            entry.update({key: safe_get_full_optimizer_state(param, key) for key in keys})
        state[name] = {k: v.detach().clone().cpu() if v is not None else None for k, v in entry.items()}
    return state


def _optimizer_steps(engine: Any) -> list[float]:
    """Every step the wrapped torch optimizer keeps (one per flat sub-group / group partition; a schedule-free
    optimizer's per param group)."""
    inner = engine.optimizer.optimizer
    per_state = [float(s["step"]) for s in inner.state.values() if "step" in s]
    return per_state or [float(g["k"]) for g in inner.param_groups if "k" in g]  # schedule-free counts in groups


def _backend_args(spec: HfSpec, fsdp: dict[str, Any] | None) -> dict[str, Any]:
    """TrainingArguments that choose the backend: DeepSpeed in bf16 (``extra["fp32"]``: in fp32, to compare with an
    FSDP run step for step; use_cpu picks its CPU accelerator), or FSDP in fp32 (use_cpu=False: with it accelerate
    would run DDP, see fsdp_worker.enable_cpu_fsdp)."""
    if fsdp is None:
        return dict(bf16=not spec.extra.get("fp32"), use_cpu=True, deepspeed=ds_config(spec))
    from tests.support.fsdp_worker import trainer_fsdp_config

    return dict(bf16=False, use_cpu=False, fsdp=True, fsdp_config=trainer_fsdp_config(fsdp))


def _run_trainer(spec: HfSpec, rank: int) -> None:
    from tests.support.fsdp_worker import (
        assert_fsdp,
        enable_cpu_fsdp,
        fsdp_options,
        fsdp_record,
        fsdp_state,
        fsdp_steps,
    )

    fsdp = fsdp_options(spec.extra)
    if fsdp is not None:
        enable_cpu_fsdp(fsdp)  # before TrainingArguments sets up the process state

    from transformers import Trainer, TrainerCallback, TrainingArguments

    record = Path(spec.record)

    def live() -> dict[str, Any]:
        """The live engine's state, steps and weight decays (collective: every rank calls)."""
        engine = trainer.model_wrapped
        if fsdp is not None:
            return fsdp_record(engine, trainer.optimizer, fsdp)
        return {
            "state": _engine_state(engine),
            "steps": _optimizer_steps(engine),
            "weight_decay": sorted({g["weight_decay"] for g in engine.optimizer.optimizer.param_groups}),
        }

    class Recorder(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            if fsdp is not None:  # a silent DDP (or unwrapped) run fails here
                if not trainer.is_fsdp_enabled:
                    raise RuntimeError("Trainer runs without FSDP")
                assert_fsdp(trainer.model_wrapped, fsdp, trainer.accelerator)
            loaded = {"global_step": state.global_step, **live()}
            if rank == 0:
                torch.save(loaded, record / "loaded.pt")

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if fsdp is None:
                return
            saved = {"global_step": state.global_step, **live()}
            if rank == 0:
                torch.save(saved, record / f"saved_{state.global_step}.pt")

    class RecordingTrainer(Trainer):
        def _load_rng_state(self, checkpoint: str | None) -> None:
            super()._load_rng_state(checkpoint)
            torch.save({"cpu": torch.random.get_rng_state()}, record / f"rng_loaded_{rank}.pt")

    args = TrainingArguments(
        output_dir=spec.out,
        per_device_train_batch_size=spec.per_device,
        gradient_accumulation_steps=spec.accum,
        max_steps=spec.max_steps,
        save_strategy="steps",
        save_steps=spec.save_steps,
        learning_rate=1e-2,
        weight_decay=0.1,
        lr_scheduler_type="linear",
        logging_steps=1,
        report_to="none",
        seed=spec.seed,
        ddp_backend="gloo",
        **_backend_args(spec, fsdp),
        dataloader_num_workers=0,
        disable_tqdm=True,
        **({"optim": spec.extra["optim"]} if "optim" in spec.extra else {}),  # Trainer's optimizer by name
    )
    trainer = RecordingTrainer(
        model=_model(spec), args=args, train_dataset=_Tokens(spec.samples, 7), callbacks=[Recorder()]
    )
    if spec.live_from:
        from ucp.integrations.hf import resume_trainer

        resume_trainer(trainer, spec.live_from)
    else:
        trainer.train(resume_from_checkpoint=spec.resume)
    engine = trainer.model_wrapped
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    if fsdp is not None:
        final = {
            "global_step": trainer.state.global_step,
            "steps": fsdp_steps(trainer.optimizer),
            "losses": losses,
            "state": fsdp_state(engine, trainer.optimizer),
            "backend": f"fsdp{fsdp['version']}",
        }
    else:
        final = {
            "global_step": trainer.state.global_step,
            "engine_global_steps": engine.global_steps,
            "steps": _optimizer_steps(engine),
            "losses": losses,
            "state": _engine_state(engine),
        }
    if rank == 0:
        torch.save(final, record / "final.pt")


def main(argv: list[str]) -> None:
    spec = HfSpec(**json.loads(argv[1]))
    rank = int(os.environ["RANK"])
    Path(spec.record).mkdir(parents=True, exist_ok=True)
    _run_trainer(spec, rank)


if __name__ == "__main__":
    main(sys.argv)
    end_rank()
