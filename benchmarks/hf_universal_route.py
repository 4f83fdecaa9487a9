"""DeepSpeed's own universal route against ucp's, on real Hugging Face Trainer runs (measured for docs/hf.md).

A Trainer + DeepSpeed ZeRO-3 bf16 run is saved at 2 processes (checkpoint-4), then resumed at 3:
- DeepSpeed's route: ``ds_to_universal`` on the tag, ``latest_universal``, ``checkpoint.load_universal``;
- ucp's route: ``ucp restore checkpoint-4 NEW --dp 3``.
The state each resume holds right after the load (fp32 masters, exp_avg, exp_avg_sq gathered with
DeepSpeed's ``safe_get_full_*``, every optimizer step) is compared with DeepSpeed's own native load at 2
processes, the truth. Two optimizers: Trainer's torch AdamW (no optimizer block: a decay and a no-decay
group, float step tensors) and the DeepSpeed-config AdamW the Hugging Face docs suggest; both with a
small ``sub_group_size`` so a param group spans several ZeRO-3 sub-groups, as any model over ~1B
parameters does at DeepSpeed's default.

Run: ``PYTHONPATH=. DS_ACCELERATOR=cpu python benchmarks/hf_universal_route.py [WORK]`` (about 3 minutes
on 2 cores; the saves are cached with the test fixtures).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tests.support.hf_runs import cached_run, run_hf
from tests.support.hf_worker import HfSpec
from ucp.io import torchfile
from ucp.targets.hf import write_hf

SAVED_AT = 4
#: the DeepSpeed-config optimizer of the Hugging Face DeepSpeed docs ("auto" values filled by Trainer)
DS_ADAMW = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}


def _compare(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    """Per state key: how many parameters differ from the truth, and the largest absolute difference."""
    out: dict[str, Any] = {}
    for name, tensors in want["state"].items():
        for key, value in tensors.items():
            mine = got["state"].get(name, {}).get(key)
            entry = out.setdefault(key, {"params": 0, "differ": 0, "max_abs": 0.0})
            entry["params"] += 1
            if mine is None or mine.shape != value.shape:
                entry["differ"] += 1
                entry["max_abs"] = float("inf")
            elif not torch.equal(mine, value):
                entry["differ"] += 1
                entry["max_abs"] = max(entry["max_abs"], float((mine.float() - value.float()).abs().max()))
    out["steps"] = sorted(set(got["steps"]))
    out["weight_decays"] = got.get("weight_decay")
    return out


def _after(run: Any, truth: Any) -> dict[str, Any]:
    """After 3 more steps: the optimizer steps, and how far masters and losses are from the native resume."""
    got, want = run.final(), truth.final()
    return {
        "steps": sorted(set(got["steps"])),
        "max_fp32_diff": max(
            float((got["state"][p]["fp32"] - v["fp32"]).abs().max()) for p, v in want["state"].items()
        ),
        "loss_diff": {k: round(v - want["losses"][k], 6) for k, v in got["losses"].items() if k > SAVED_AT},
    }


def _ds_universal(ckpt: Path, work: Path) -> Path:
    """A copy of ``ckpt`` with DeepSpeed's universal folder beside the tag, as its docs say."""
    folder = work / f"checkpoint-{SAVED_AT}"
    shutil.copytree(ckpt, folder)
    tag = f"global_step{SAVED_AT}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(folder / tag),
            "--output_folder",
            str(folder / f"{tag}_universal"),
        ],
        check=True,
        capture_output=True,
    )
    (folder / "latest_universal").write_text(f"{tag}_universal")
    return folder


def measure(name: str, extra: dict[str, Any], work: Path) -> dict[str, Any]:
    base = HfSpec(world=2, stage=3, sub_group_size=200, extra=extra)
    saved = cached_run(f"route-{name}-save", base)
    ckpt = saved.out / f"checkpoint-{SAVED_AT}"
    native = cached_run(f"route-{name}-native", replace(base, resume=str(ckpt)))
    truth = native.loaded()
    resumed = replace(base, world=3, per_device=2, accum=2)  # global batch 12, as 2 x 2 x 3

    ds_folder = _ds_universal(ckpt, work / name / "ds")
    ds_extra = {"ds_config": {**extra.get("ds_config", {}), "checkpoint": {"load_universal": True}}}
    ds_run = run_hf(
        replace(
            resumed,
            resume=str(ds_folder),
            extra=ds_extra,
            out=str(work / name / "ds-out"),
            record=str(work / name / "ds-rec"),
        )
    )

    ucp_folder = work / name / "ucp" / f"checkpoint-{SAVED_AT}"
    write_hf(ckpt, ucp_folder, dp=3)
    ucp_run = run_hf(
        replace(resumed, resume=str(ucp_folder), out=str(work / name / "ucp-out"), record=str(work / name / "ucp-rec"))
    )
    rank0 = torchfile.load(ckpt / f"global_step{SAVED_AT}" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    groups = len(rank0["optimizer_state_dict"]["fp32_flat_groups"])
    return {
        "sub_groups": groups,
        "deepspeed": {"loaded": _compare(ds_run.loaded(), truth), "after": _after(ds_run, native)},
        "ucp": {"loaded": _compare(ucp_run.loaded(), truth), "after": _after(ucp_run, native)},
    }


def main(argv: list[str]) -> None:
    work = Path(argv[1]) if len(argv) > 1 else Path(tempfile.mkdtemp(prefix="ucp-route-"))
    results = {
        "trainer-torch-adamw": measure("torch", {}, work),
        "ds-config-adamw": measure("dsadamw", {"ds_config": {"optimizer": DS_ADAMW}}, work),
    }
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv)
