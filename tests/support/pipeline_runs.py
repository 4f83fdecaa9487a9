"""Real pipeline-parallel DeepSpeed runs (ucp.harness.pipeline), built once and cached like the other fixtures."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tests.support.fixtures import build_once, cache_root, spec_key
from ucp.harness.pipeline import PipeSpec, run_pipeline

__all__ = [
    "BuiltPipe",
    "assert_reader_matches_stages",
    "build_pipe",
    "merged_record",
    "tp_merged",
    "run_pipe",
    "run_through",
    "universal_of",
    "stage_records",
    "tp_records",
]

_VERSION = "1"  # bump when the pipeline harness model or data change


@dataclass(frozen=True)
class BuiltPipe:
    """A pipeline checkpoint DeepSpeed wrote, and each stage's live state when it wrote it."""

    path: Path  # the folder holding `latest`
    spec: PipeSpec

    @property
    def records(self) -> list[dict[str, Any]]:
        return stage_records(self.spec)

    @property
    def tag_dir(self) -> Path:
        return self.path / (self.path / "latest").read_text().strip()


def stage_records(spec: PipeSpec) -> list[dict[str, Any]]:
    """Each stage's record of a finished run (one for a plain run; TP rank 0's under tensor parallelism)."""
    stages = 1 if spec.plain else spec.pp
    return [torch.load(spec.record_path(s), weights_only=True) for s in range(stages)]


def tp_records(spec: PipeSpec) -> list[list[dict[str, Any]]]:
    """Each stage's records, one per TP rank, of a finished pipeline run."""
    return [[torch.load(spec.record_path(s, t), weights_only=True) for t in range(spec.tp)] for s in range(spec.pp)]


def build_pipe(**fields: Any) -> BuiltPipe:
    """Train and save a pipeline checkpoint with PipeSpec(**fields), or return the cached one."""
    spec = PipeSpec(**fields)
    tp = f"-tp{spec.tp}" if spec.tp > 1 else ""
    folder = cache_root() / f"pipe-pp{spec.pp}{tp}-dp{spec.dp}-z{spec.stage}-{spec.dtype}-{spec_key(_VERSION, spec)}"
    spec = replace(spec, save_dir=str(folder / "ckpt"), record=str(folder / "record.pt"))
    build_once(folder, lambda: run_pipeline(spec, log_dir=folder / "logs"))
    return BuiltPipe(folder / "ckpt", spec)


def run_pipe(
    base: BuiltPipe, *, name: str, work: Path, steps: int = 3, per_tp: bool = False, **overrides: Any
) -> list[Any]:
    """Continue ``base``'s run for ``steps`` more steps as ``overrides`` say (a load, another PP, TP or DP
    size, a plain engine); return each stage's live record (with ``per_tp``, each stage's list of them)."""
    spec = replace(
        base.spec,
        steps=steps,
        first_step=base.spec.steps,
        save_dir=None,
        record=str(work / f"{name}.pt"),
        port=0,
        **overrides,
    )
    run_pipeline(spec, log_dir=work / f"{name}-logs")
    return tp_records(spec) if per_tp else stage_records(spec)


def _through_spec(base: BuiltPipe, work: Path, steps: int) -> PipeSpec:
    return replace(base.spec, steps=base.spec.steps + steps, save_dir=None, record=str(work / "through.pt"), port=0)


def run_through(base: BuiltPipe, *, steps: int = 3, per_tp: bool = False) -> list[Any]:
    """``base``'s run without the interruption: its steps and ``steps`` more in one go, nothing loaded.
    Cached next to ``base`` (a deterministic function of it), so every test module shares one run."""
    folder = base.path.parent / f"through-{steps}"
    spec = _through_spec(base, folder, steps)
    build_once(folder, lambda: run_pipeline(spec, log_dir=folder / "logs"))
    return tp_records(spec) if per_tp else stage_records(spec)


def universal_of(base: BuiltPipe, factory: Any) -> Path:
    """``base`` converted by ucp into a fresh universal directory (``factory``: pytest's tmp_path_factory)."""
    import ucp

    out = factory.mktemp("universal") / "u"
    ucp.to_universal(base.path, out)
    return out


def merged_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The stages' records as one model: each parameter from the first stage holding it. A tied module's
    copies on later stages must be the same bytes (DeepSpeed all-reduces their gradients)."""
    out: dict[str, Any] = {"params": {}, "state": {}, "module": {}, "buffers": {}, "frozen": [], "steps": set()}
    for rec in records:
        for name, value in rec["params"].items():
            if name in out["params"]:
                assert torch.equal(out["params"][name], value), name
                assert all(torch.equal(out["state"][k][name], rec["state"][k][name]) for k in rec["state"]), name
                continue
            out["params"][name] = value
            for key, per_param in rec["state"].items():
                out["state"].setdefault(key, {})[name] = per_param[name]
        out["module"].update(rec["module"])
        out["buffers"].update(rec["buffers"])
        out["frozen"] += rec["frozen"]
        out["steps"] |= set(rec["state_steps"])
    return out


def tp_full(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """A harness parameter whole from its TP ranks' shards, as the harness cuts them (ucp.harness.pipeline):
    fc1 by rows, fc2's weight by columns, the rest replicated (whose copies must be equal)."""
    if ".fc1." in name:
        return torch.cat(shards, 0)
    if name.endswith(".fc2.weight"):
        return torch.cat(shards, 1)
    assert all(torch.equal(shards[0], s) for s in shards[1:]), f"{name}: replicated, but TP ranks differ"
    return shards[0]


def tp_merged(stage: list[dict[str, Any]]) -> dict[str, Any]:
    """One stage's records, one per TP rank, as the record of one rank holding whole parameters."""
    first = stage[0]
    out = dict(first)
    out["params"] = {n: tp_full(n, [r["params"][n] for r in stage]) for n in first["params"]}
    out["state"] = {k: {n: tp_full(n, [r["state"][k][n] for r in stage]) for n in v} for k, v in first["state"].items()}
    out["module"] = {n: tp_full(n, [r["module"][n] for r in stage]) for n in first["module"]}
    for rec in stage[1:]:
        assert rec["losses"] == first["losses"] and rec["state_steps"] == first["state_steps"]
        assert all(torch.equal(v, first["buffers"][k]) for k, v in rec["buffers"].items())
    return out


def assert_reader_matches_stages(reader, pipe: BuiltPipe) -> None:
    """Every parameter, state tensor, step and buffer the reader gives is what the stages' engines held."""
    expected = merged_record(pipe.records)
    assert expected["steps"] == {float(pipe.spec.steps)}
    assert sorted(expected["state"]) == ["exp_avg", "exp_avg_sq"]
    facts = reader.facts
    names = [p.name for p in facts.params]
    assert len(names) == len(set(names)), "a tied module is kept once"
    assert {p.name for p in facts.params if not p.frozen} == set(expected["params"])
    assert sorted(p.name for p in facts.params if p.frozen) == sorted(expected["frozen"])
    assert facts.step == pipe.spec.steps and facts.info.dp_world_size == pipe.spec.dp
    assert facts.info.dtype == pipe.spec.dtype
    for meta in facts.params:
        state = reader.read(meta.name)
        if meta.frozen:
            assert torch.equal(state.fp32, expected["module"][meta.name].float()), meta.name
            continue
        assert torch.equal(state.fp32, expected["params"][meta.name]), meta.name
        assert list(state.optim) == ["exp_avg", "exp_avg_sq"], meta.name
        for key, value in state.optim.items():
            assert torch.equal(value, expected["state"][key][meta.name].float()), (meta.name, key)
        assert state.step == pipe.spec.steps, meta.name
    buffers = reader.buffers()
    assert set(buffers) == set(expected["buffers"]) == {"1.calls"}
    assert all(torch.equal(v, expected["buffers"][k]) for k, v in buffers.items())
    lives = pipe.records[0]["group_hparams"]
    assert [(g.hyper.lr, g.hyper.weight_decay) for g in facts.groups] == [(g["lr"], g["weight_decay"]) for g in lives]
