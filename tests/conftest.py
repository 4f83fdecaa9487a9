"""Shared fixtures: real DeepSpeed checkpoints (cached on disk) and their native-resume references."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("UCP_HARNESS_FORK", "1")  # CPU ranks fork from a parent holding torch and DeepSpeed

from tests.support.fixtures import Built, build, resume, universals_of  # noqa: E402
from ucp.harness import LoadSpec, ModelSpec  # noqa: E402
from ucp.harness.launch import NO_RANKS  # noqa: E402

#: The source checkpoints of the suite: ZeRO-3 across DP 1-4, fp32/bf16, three optimizers,
#: one to three param groups, several sub-groups, frozen + tied params and buffers in every one;
#: ZeRO-1/2 at DP 2-3 with two and three param groups.
SOURCES: dict[str, dict[str, Any]] = {
    "z3-fp32-dp1-adamw": dict(dp=1, stage=3, dtype="fp32", optimizer="torch-adamw", param_groups=1),
    "z3-bf16-dp2-adamw": dict(dp=2, stage=3, dtype="bf16", optimizer="torch-adamw", sub_group_size=60),
    "z3-fp32-dp2-adamw": dict(dp=2, stage=3, dtype="fp32", optimizer="torch-adamw", sub_group_size=60),
    "z3-fp32-dp3-adamw": dict(dp=3, stage=3, dtype="fp32", optimizer="torch-adamw", param_groups=3, sub_group_size=100),
    "z3-fp32-dp4-adam": dict(dp=4, stage=3, dtype="fp32", optimizer="torch-adam", sub_group_size=40),
    "z3-bf16-dp4-fused": dict(dp=4, stage=3, dtype="bf16", optimizer="ds-fused-adam", sub_group_size=60),
    # ZeRO-Infinity on CPU: optimizer and parameters offloaded
    "z3-bf16-dp2-cpuadam": dict(
        dp=2, stage=3, dtype="bf16", optimizer="ds-cpu-adam", offload=True, offload_param=True, param_groups=3
    ),
    # ZeRO-1/2: DeepSpeedZeroOptimizer at both stages, and BF16_Optimizer (bf16 + fp32 grad accumulation)
    "z1-fp32-dp2-adamw": dict(dp=2, stage=1, dtype="fp32", optimizer="torch-adamw"),
    "z2-bf16-dp3-adamw": dict(dp=3, stage=2, dtype="bf16", optimizer="torch-adamw", param_groups=3),
    "z1-bf16-dp2-bf16opt": dict(dp=2, stage=1, dtype="bf16", optimizer="torch-adamw", grad_accum_dtype="fp32"),
}

#: Tensor-parallel sources (DeepSpeed AutoTP, TP=2): their records hold each TP rank's shards, so
#: they live apart from SOURCES (whose tests compare records with full tensors).
TP_SOURCES: dict[str, dict[str, Any]] = {
    "tp2-z1-bf16-dp2-glu": dict(dp=2, tp=2, stage=1, dtype="bf16", optimizer="torch-adamw", model=ModelSpec(glu=True)),
    "tp2-z2-fp32-dp1": dict(dp=1, tp=2, stage=2, dtype="fp32", optimizer="torch-adamw"),
}

#: Optimizers beyond Adam (tests/test_optimizers.py), each with the options that give it the most state.
OPTIMIZER_SOURCES: dict[str, dict[str, Any]] = {
    "z3-fp32-amsgrad": dict(dp=2, stage=3, dtype="fp32", optimizer="torch-adamw-amsgrad", sub_group_size=60),
    "z3-bf16-sgd": dict(dp=2, stage=3, dtype="bf16", optimizer="torch-sgd"),
    "z2-fp32-rmsprop": dict(dp=2, stage=2, dtype="fp32", optimizer="torch-rmsprop"),
    "z3-fp32-nadam": dict(dp=2, stage=3, dtype="fp32", optimizer="torch-nadam"),
    "z1-bf16-nadam": dict(dp=2, stage=1, dtype="bf16", optimizer="torch-nadam"),
    "z1-fp32-adamax": dict(dp=2, stage=1, dtype="fp32", optimizer="torch-adamax"),
    "z2-bf16-radam": dict(dp=2, stage=2, dtype="bf16", optimizer="torch-radam"),
    "z3-fp32-lion": dict(dp=2, stage=3, dtype="fp32", optimizer="ds-cpu-lion", offload=True),
    "z2-fp32-adagrad": dict(dp=2, stage=2, dtype="fp32", optimizer="ds-cpu-adagrad", offload=True),
    # MuonWithAuxAdam: momentum_buffer on the matrices' groups (no step), Adam moments and a step on the rest
    "z3-fp32-muon": dict(dp=2, stage=3, dtype="fp32", optimizer="ds-muon"),
    # at ZeRO-1/2 each rank keeps the whole momentum of every matrix reaching its partition: SwiGLU's fused
    # gate+up (2x the down projection) and three layers put a partition boundary inside a matrix at dp 2 and 3
    "z2-fp32-muon": dict(dp=2, stage=2, dtype="fp32", optimizer="ds-muon", model=ModelSpec(glu=True, layers=3)),
    # with the optimizer offloaded, the momentum is the rank's flat partition like any other state
    "z1-bf16-muon-offload": dict(
        dp=2, stage=1, dtype="bf16", optimizer="ds-muon", offload=True, model=ModelSpec(glu=True, layers=3)
    ),
    "z1-fp32-adadelta": dict(dp=2, stage=1, dtype="fp32", optimizer="torch-adadelta"),
    "z3-fp32-rprop": dict(dp=2, stage=3, dtype="fp32", optimizer="torch-rprop", sub_group_size=60),
    # 0-dim eta and mu per flat tensor, from the step and the group's lr
    "z2-bf16-asgd": dict(dp=2, stage=2, dtype="bf16", optimizer="torch-asgd"),
    # Adafactor sees ZeRO's flat partitions as vectors: an unfactored variance, scaled by each partition's RMS
    # sizes that leave no ZeRO-3 padding at DP 2: DeepSpeed leaves a partition's padding uninitialized, and torch's
    # Adafactor scales its step by the norm of the whole flat partition (one CI build went NaN; docs/format.md)
    "z3-fp32-adafactor": dict(
        dp=2, stage=3, dtype="fp32", optimizer="torch-adafactor", model=ModelSpec(vocab=38, ffn=24)
    ),
    # transformers' Adafactor (Trainer's optim="adafactor"): its RMS is each rank's, recomputed every step
    "z2-fp32-hf-adafactor": dict(dp=2, stage=2, dtype="fp32", optimizer="hf-adafactor"),
    # schedule-free (axolotl's, and Trainer's optim="schedule_free_adamw"): its step k, weight_sum and lr_max in the
    # group, z per parameter; at ZeRO-3 DeepSpeed calls it once per sub-group, and it counts every call
    "z1-fp32-sf-adamw": dict(dp=2, stage=1, dtype="fp32", optimizer="sf-adamw"),
    "z2-bf16-sf-adamw": dict(dp=2, stage=2, dtype="bf16", optimizer="sf-adamw"),
    "z3-fp32-sf-sgd": dict(dp=2, stage=3, dtype="fp32", optimizer="sf-sgd"),
}


@pytest.fixture(scope="session")
def source() -> Callable[[str], Built]:
    """source(name) -> a cached real checkpoint from SOURCES, TP_SOURCES or OPTIMIZER_SOURCES."""
    return lambda name: build(**{**SOURCES, **TP_SOURCES, **OPTIMIZER_SOURCES}[name])


@pytest.fixture(scope="session")
def native_resume(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Built], dict[str, Any]]:
    """The reference: DeepSpeed's own resume of a checkpoint at its own DP size, 3 more steps."""
    cache: dict[str, dict[str, Any]] = {}
    work = tmp_path_factory.mktemp("native")

    def get(base: Built) -> dict[str, Any]:
        key = str(base.path)
        if key not in cache:
            cache[key] = resume(base, LoadSpec(str(base.path)), name=f"native{len(cache)}", work=work)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def universals(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """universals(name) -> a universal directory converted once from source(name)."""
    return universals_of({**SOURCES, **TP_SOURCES, **OPTIMIZER_SOURCES}, tmp_path_factory.mktemp("universals"))


@pytest.fixture(scope="session")
def z3_bf16_dp2(source: Callable[[str], Built]) -> Built:
    return source("z3-bf16-dp2-adamw")


@pytest.fixture(scope="session")
def z3_fp32_dp3(source: Callable[[str], Built]) -> Built:
    return source("z3-fp32-dp3-adamw")


def pytest_configure(config: pytest.Config) -> None:
    """``-m "not slow"`` is the fast tier: real runs are refused (a test that needs one is marked slow), so the tier
    proves it trains nothing and reads only what tests/data keeps."""
    if "not slow" in (config.option.markexpr or ""):
        os.environ[NO_RANKS] = "1"
