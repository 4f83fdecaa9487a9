"""The benchmark's input builder (benchmarks/synth_checkpoint.py) writes what real DeepSpeed writes: a DeepSpeed
engine at the written DP size loads its files and then holds, bit for bit, every master, both Adam moments and the
step the builder put there (and the bf16 weights are the masters rounded); ucp reads them as the same values.
The benchmark's large points are only as meaningful as this."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.support.fixtures import refuse_in_fast_tier
from ucp.harness.launch import run_ranks
from ucp.harness.spec import LoadSpec, ModelSpec, RunSpec

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _builder() -> ModuleType:
    """benchmarks/synth_checkpoint.py as a module (benchmarks/ is not a package on the path)."""
    if "synth_checkpoint" not in sys.modules:
        spec = importlib.util.spec_from_file_location("synth_checkpoint", BENCH / "synth_checkpoint.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["synth_checkpoint"] = module
        spec.loader.exec_module(module)
    return sys.modules["synth_checkpoint"]


def _expected(builder: ModuleType, spec) -> dict[str, dict[str, torch.Tensor]]:
    values = builder.Values(spec.seed)
    return {
        key: {p.name: values.full(key, i, p.numel).view(p.shape) for i, p in enumerate(spec.params)}
        for key in ("fp32", "exp_avg", "exp_avg_sq")
    }


def test_the_layout_is_deepspeeds_zero3_partitioning() -> None:
    """Each rank holds ceil(numel / dp) elements of every parameter, in group order, the last rank zero-padded."""
    builder = _builder()
    from bench.shapes import SynthSpec, tiny_lm

    spec = SynthSpec(tiny_lm(37, 10, 23, 1), dp=3)
    values = builder.Values(0)
    flats = [builder.rank_flats(spec, values, rank) for rank in range(3)]
    for g, group in enumerate(spec.groups):
        whole = torch.cat([f[g]["fp32"] for f in flats])
        assert whole.numel() == 3 * spec.group_partition(g)
        offset, index0 = 0, sum(len(spec.groups[h]) for h in range(g))
        for i, param in enumerate(group):
            size = spec.partition(param)
            pieces = [
                whole[r * spec.group_partition(g) + offset : r * spec.group_partition(g) + offset + size]
                for r in range(3)
            ]
            joined = torch.cat(pieces)
            assert torch.equal(joined[: param.numel], values.full("fp32", index0 + i, param.numel)), param.name
            assert not joined[param.numel :].any(), param.name
            offset += size


def test_the_layout_is_deepspeeds_zero12_partitioning() -> None:
    """Each group's parameters lie end to end across the ranks' partitions, padded to a multiple of 2 x dp; the
    paddings, the masters saved without them and the slice mappings say where."""
    builder = _builder()
    from bench.shapes import SynthSpec, tiny_lm

    spec = SynthSpec(tiny_lm(37, 10, 23, 1), dp=4, stage=2, step=2)
    values = builder.Values(0)
    blocks = [
        builder.optim_states(spec, builder.rank_flats(spec, values, rank), "0.19.8", rank)["optimizer_state_dict"]
        for rank in range(4)
    ]
    index0 = 0
    for g, group in enumerate(spec.groups):
        size, numel = spec.group_partition(g), spec.group_numel(g)
        assert (4 * size) % 8 == 0 and numel <= 4 * size < numel + 8
        for key in ("exp_avg", "exp_avg_sq"):
            whole = torch.cat([b["base_optimizer_state"]["state"][g][key] for b in blocks])
            expected = torch.cat([values.full(key, index0 + i, p.numel) for i, p in enumerate(group)])
            assert torch.equal(whole[:numel], expected) and not whole[numel:].any()
        masters = [b["single_partition_of_fp32_groups"][g] for b in blocks]
        pads = [b["group_paddings"][g] for b in blocks]
        assert [m.numel() + pad for m, pad in zip(masters, pads)] == [size] * 4 and sum(pads) == 4 * size - numel
        fp32 = torch.cat(masters)
        assert torch.equal(fp32, torch.cat([values.full("fp32", index0 + i, p.numel) for i, p in enumerate(group)]))
        offset = 0
        for i, param in enumerate(group):
            got = []
            for rank, block in enumerate(blocks):
                where = block["param_slice_mappings"][g].get(param.name)
                if where is not None:
                    assert rank * size + where.start == offset + sum(t.numel() for t in got), param.name
                    flat = block["base_optimizer_state"]["state"][g]["exp_avg"]
                    got.append(flat[where.start : where.start + where.numel])
            assert torch.equal(torch.cat(got), values.full("exp_avg", index0 + i, param.numel)), param.name
            offset += param.numel
        index0 += len(group)


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "dtype", "stage"), [(3, "bf16", 3), (2, "fp32", 3), (3, "bf16", 2), (2, "fp32", 1)])
def test_real_deepspeed_loads_the_built_checkpoint_and_holds_its_values(
    tmp_path: Path, dp: int, dtype: str, stage: int
) -> None:
    refuse_in_fast_tier("a DeepSpeed engine loading a synthetic checkpoint")
    builder = _builder()
    from bench.shapes import SynthSpec, tiny_lm

    spec = SynthSpec(tiny_lm(37, 10, 23, 2), dp=dp, dtype=dtype, stage=stage, step=5, seed=3)
    builder.write_checkpoint(spec, tmp_path / "ckpt")
    model = ModelSpec(vocab=37, hidden=10, ffn=23, layers=2, tied=False, frozen=False, buffers=False)
    run = RunSpec(
        dp=dp,
        stage=stage,
        dtype=dtype,
        model=model,
        steps=0,
        scheduler=False,
        load=LoadSpec(str(tmp_path / "ckpt"), kind="native"),
        record=str(tmp_path / "record.pt"),
    )
    run_ranks(run, log_dir=tmp_path / "logs")
    record = torch.load(tmp_path / "record.pt", weights_only=True)
    expected = _expected(builder, spec)
    assert sorted(record["params"]) == sorted(p.name for p in spec.params)
    weight = torch.bfloat16 if dtype == "bf16" else torch.float32
    for name, master in expected["fp32"].items():
        assert torch.equal(record["params"][name], master), name
        assert torch.equal(record["module"][name], master.to(weight)), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(record[key][name], expected[key][name]), (name, key)
    assert record["state_steps"] == [5.0, 5.0]
    assert record["counters"]["global_steps"] == 5

    import ucp

    ucp.to_universal(tmp_path / "ckpt", tmp_path / "u")
    with ucp.open_universal(tmp_path / "u") as reader:
        for name, master in expected["fp32"].items():
            state = reader.read(name)
            assert torch.equal(state.fp32, master) and state.step == 5, name
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state.optim[key], expected[key][name]), (name, key)


def test_the_spec_round_trips_through_json() -> None:
    _builder()
    from bench.shapes import SynthSpec, llama_model

    spec = SynthSpec(llama_model(2, 64, 128, 16, 100), dp=8, label="x")
    assert SynthSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
