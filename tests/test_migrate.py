"""ucp migrate: every example in configs/ runs against real checkpoints, and bad configs are refused
before any work, each problem with its key path and line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import ucp.targets.export  # noqa: F401  the exports these tests run: a broken import fails them, never skips
from tests.support.fixtures import resume
from ucp.cli import main
from ucp.errors import ConfigError, OutputExistsError
from ucp.harness import LoadSpec
from ucp.migrate import MigrationConfigError, load_config, run_migration
from ucp.sources import open_reader
from ucp.sources.dcp import DcpSource
from ucp.universal.reader import open_universal

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
EXAMPLES = ("dp8_to_dp4", "adamw_to_ds_fused_adam", "hf_export", "drop_head_reset", "tp2_to_tp1")


def _example(name: str, folder: Path, **values: str) -> Path:
    """configs/NAME.yaml copied into ``folder`` with only the given keys' values replaced."""
    text = (CONFIGS / f"{name}.yaml").read_text()
    for key, value in values.items():
        pattern = re.compile(rf"^(\s*(?:- )?{key}:[ \t]*)[^\s#]+", re.M)
        text, count = pattern.subn(lambda m, value=value: m.group(1) + json.dumps(value), text)
        assert count == 1, f"configs/{name}.yaml should set {key}: exactly once"
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


def _config(folder: Path, text: str, name: str = "m.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def _problems(path: Path, *, overwrite: bool = False) -> str:
    with pytest.raises(ConfigError) as caught:
        run_migration(path, dry_run=True, overwrite=overwrite)
    return str(caught.value)


def _close(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(a))


# -- the examples -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", EXAMPLES)
def test_every_example_config_is_valid_as_written(name):
    config = load_config(CONFIGS / f"{name}.yaml")
    assert config.source.is_absolute()  # relative paths resolve against configs/


@pytest.mark.slow
def test_tp2_to_tp1_example_merges_the_tensor_parallel_ranks(source, tmp_path):
    from ucp.sources import open_reader

    built = source("tp2-z2-fp32-dp1")  # a real DeepSpeed AutoTP run
    path = _example("tp2_to_tp1", tmp_path, source=str(built.path), universal="out/universal", output="out/tp1")
    assert "dp=2" in run_migration(path, dry_run=True)
    run_migration(path)
    manifest = json.loads((tmp_path / "out/universal/ucp.json").read_text())
    assert manifest["tensor_parallel"]["source_degree"] == 2
    assert manifest["tensor_parallel"]["rules"]["blocks.0.2.weight"] == {"kind": "split", "dim": 1}
    native, merged = open_reader(tmp_path / "out/tp1"), open_reader(built.path)
    try:
        assert native.facts.info.mp_world_size == 1
        assert sorted(p.name for p in (tmp_path / "out/tp1").glob("*/mp_rank_*")) == ["mp_rank_00_model_states.pt"]
        for meta in merged.facts.params:
            a, b = native.read(meta.name), merged.read(meta.name)
            assert a.fp32.shape == meta.shape and torch.equal(a.fp32, b.fp32), meta.name
            assert meta.frozen or (torch.equal(a.optim["exp_avg"], b.optim["exp_avg"]) and a.step == b.step), meta.name
    finally:
        native.close()
        merged.close()


@pytest.mark.slow
def test_dp8_to_dp4_example_resumes_at_dp4_like_a_native_resume(z3_bf16_dp2, native_resume, tmp_path):
    """The example's source DP is whatever the checkpoint says (here 2, not 8: an 8-rank fixture
    would cost another DeepSpeed run); its target, DP 4, is what is tested."""
    path = _example("dp8_to_dp4", tmp_path, source=str(z3_bf16_dp2.path), universal="out/universal", output="out/dp4")
    text = run_migration(path)
    assert "dp=4" in text
    manifest = json.loads((tmp_path / "out/universal/ucp.json").read_text())
    assert len(manifest["params"]) == 13 and manifest["tied"] == {"head.weight": "embed.weight"}

    ours = resume(z3_bf16_dp2, LoadSpec(str(tmp_path / "out/dp4")), dp=4, name="dp4", work=tmp_path)
    native = native_resume(z3_bf16_dp2)
    # the first loss comes from the loaded weights alone; later ones differ by dp=2 vs 4 reduction order
    assert _close(ours["losses"][0], native["losses"][0], 1e-5), (ours["losses"], native["losses"])
    assert all(_close(a, b, 1e-3) for a, b in zip(ours["losses"], native["losses"])), (ours["losses"], native["losses"])
    for key in ("params", "exp_avg", "exp_avg_sq"):  # seen here: at most 5e-4 apart
        for name, value in native[key].items():
            assert torch.allclose(ours[key][name], value, rtol=0, atol=2e-3), (key, name)
    assert ours["counters"] == native["counters"] and ours["lrs"] == native["lrs"]
    assert set(ours["state_steps"]) == {6.0}


@pytest.mark.slow
def test_adamw_to_ds_fused_adam_example_trains_on_like_adamw(z3_bf16_dp2, native_resume, tmp_path):
    path = _example("adamw_to_ds_fused_adam", tmp_path, source=str(z3_bf16_dp2.path), output="out/fused")
    config = load_config(path)
    run_migration(path)
    ours = resume(
        z3_bf16_dp2,
        LoadSpec(str(tmp_path / "out/fused")),
        dp=config.target.dp,
        name="fused",
        work=tmp_path,
        optimizer="ds-fused-adam",
    )
    native = native_resume(z3_bf16_dp2)
    # same weights, moments and step: FusedAdam's updates track torch AdamW's up to rounding
    # (seen here: equal losses, params at most 3e-7 apart)
    assert ours["losses"][0] == native["losses"][0]
    assert all(_close(a, b, 1e-3) for a, b in zip(ours["losses"], native["losses"])), (ours["losses"], native["losses"])
    for key in ("params", "exp_avg", "exp_avg_sq"):
        for name, value in native[key].items():
            assert torch.allclose(ours[key][name], value, rtol=1e-3, atol=1e-5), (key, name)
    assert ours["state_step_types"] and set(ours["state_step_types"]) == {"int"}  # FusedAdam counts in ints
    assert set(ours["state_steps"]) == {6}


@pytest.mark.slow
def test_hf_export_example_writes_the_trained_weights(z3_bf16_dp2, tmp_path):
    path = _example("hf_export", tmp_path, source=str(z3_bf16_dp2.path), path="hf-model")
    run_migration(path)
    record = z3_bf16_dp2.record
    weights = load_file(tmp_path / "hf-model" / "model.safetensors")
    assert set(weights) == set(record["module"]) | {"calls"}  # the tied head is stored once, as embed.weight
    for name, master in record["params"].items():
        assert torch.equal(weights[name], master.to(torch.bfloat16)), name
    for name in ("proj.weight", "proj.bias"):  # frozen: the model's own bf16 weights
        assert torch.equal(weights[name], record["module"][name]), name
    with safe_open(tmp_path / "hf-model" / "model.safetensors", "pt") as handle:
        assert json.loads(handle.metadata()["ucp_tied"]) == {"head.weight": "embed.weight"}


@pytest.mark.slow
def test_drop_head_reset_example_drops_the_head_and_zeroes_the_norms_moments(z3_bf16_dp2, tmp_path):
    """Checked on the universal directory, not by training: TinyLM's head is tied to the embedding,
    so a model without it is not the harness model, and `^head\\.` finds only the tied alias (the
    embedding keeps its data). Dropping a real parameter is tested below."""
    path = _example("drop_head_reset", tmp_path, source=str(z3_bf16_dp2.path), universal="finetune-start")
    text = run_migration(path)
    assert "drop head.weight" in text
    assert "reset norm.weight: moments zeroed, step kept" in text and "reset norm.bias: moments zeroed" in text
    source = open_reader(z3_bf16_dp2.path)
    out = open_universal(tmp_path / "finetune-start")
    assert out.facts.tied == {} and "head.weight" not in {p.name for p in out.facts.params}
    assert [g.params for g in out.facts.groups] == [g.params for g in source.facts.groups]
    for meta in source.facts.params:
        theirs, ours = source.read(meta.name), out.read(meta.name)
        assert torch.equal(ours.fp32, theirs.fp32), meta.name
        if meta.frozen:
            continue
        if meta.name.startswith("norm."):  # the example keeps the step (see its comments)
            assert not ours.optim["exp_avg"].any() and not ours.optim["exp_avg_sq"].any(), meta.name
        else:
            assert torch.equal(ours.optim["exp_avg"], theirs.optim["exp_avg"]) and torch.equal(
                ours.optim["exp_avg_sq"], theirs.optim["exp_avg_sq"]
            )
        assert ours.step == theirs.step == 3, meta.name
    assert set(out.buffers()) == {"calls"}
    source.close()


# -- transforms on a real checkpoint ----------------------------------------------------------
@pytest.mark.slow
def test_dropping_a_parameter_removes_its_state_its_group_slot_and_its_tied_aliases(z3_bf16_dp2, tmp_path):
    path = _config(
        tmp_path,
        f"""
source: {json.dumps(str(z3_bf16_dp2.path))}
universal: out
transforms:
  - drop: ["^embed\\\\.", "^blocks\\\\.1\\\\."]
""",
    )
    text = run_migration(path)
    assert "drop head.weight (alias; tied to dropped 'embed.weight')" in text
    out = open_universal(tmp_path / "out")
    names = {p.name for p in out.facts.params}
    assert "embed.weight" not in names and not any(n.startswith("blocks.1.") for n in names)
    assert out.facts.tied == {}
    assert out.facts.groups[0].params == ["blocks.0.0.weight", "blocks.0.2.weight"]
    assert out.facts.groups[1].params == ["blocks.0.0.bias", "blocks.0.2.bias", "norm.weight", "norm.bias"]
    assert sorted(p.name for p in (tmp_path / "out" / "zero").iterdir() if p.is_dir()) == sorted(names)


@pytest.mark.slow
def test_renames_reach_params_aliases_buffers_and_exports(z3_bf16_dp2, tmp_path):
    path = _config(
        tmp_path,
        f"""
source: {json.dumps(str(z3_bf16_dp2.path))}
transforms:
  - rename: {{pattern: "^", replace: "model."}}
  - rename: {{pattern: "^model\\\\.blocks\\\\.(\\\\d+)\\\\.", replace: "model.layers.\\\\1."}}
exports:
  - {{format: torch, path: out/pytorch_model.bin, dtype: fp32}}
""",
    )
    text = run_migration(path, dry_run=True)
    assert "model.blocks.1.2.bias -> model.layers.1.2.bias" in text and "head.weight -> model.head.weight" in text
    assert not (tmp_path / "out").exists()
    run_migration(path)
    weights = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    record = z3_bf16_dp2.record
    assert weights["model.layers.0.0.weight"].equal(record["params"]["blocks.0.0.weight"])
    assert weights["model.calls"].equal(record["buffers"]["calls"])
    assert weights["model.head.weight"] is weights["model.embed.weight"]  # the alias follows its owner


RESET_NORM = """
source: {src}
transforms:
  - reset_optimizer: {reset}
target:
  dp: 4
  output: out
"""


@pytest.mark.slow
def test_a_reset_that_splits_a_zero3_sub_group_asks_how_to_step(z3_bf16_dp2, tmp_path):
    body = RESET_NORM.format(src=json.dumps(str(z3_bf16_dp2.path)), reset='["^norm\\\\."]')
    message = _problems(_config(tmp_path, body))
    assert message.startswith(
        f"{tmp_path / 'm.yaml'}:4: transforms[0].reset_optimizer: resets norm.weight, norm.bias to step 0"
    )
    for way_out in ("{params: [...], step: keep}", "target.step: 3", "target.step: reset"):
        assert way_out in message
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_zero2_target_holds_one_step_per_param_group(z3_bf16_dp2, tmp_path):
    body = RESET_NORM.format(src=json.dumps(str(z3_bf16_dp2.path)), reset='["^norm\\\\."]')
    message = _problems(_config(tmp_path, body.replace("  dp: 4\n", "  dp: 3\n  stage: 2\n")))
    assert "in the target (ZeRO-2) they share a param group with blocks.0.0.bias (step 3)" in message


@pytest.mark.parametrize(
    "reset, extra",
    [('["^norm\\\\."]', "  step: 3\n"), ('{params: ["^norm\\\\."], step: keep}', "")],
    ids=["target-step", "reset-keeps-step"],
)
@pytest.mark.slow
def test_a_reset_that_keeps_the_step_zeroes_only_the_moments(reset, extra, z3_bf16_dp2, tmp_path):
    body = RESET_NORM.format(src=json.dumps(str(z3_bf16_dp2.path)), reset=reset) + extra
    text = run_migration(_config(tmp_path, body))
    assert "reset norm.weight: moments zeroed" in text
    native = open_reader(tmp_path / "out")
    for meta in native.facts.params:
        if meta.frozen:
            continue
        state = native.read(meta.name)
        assert state.step == 3
        assert state.optim["exp_avg"].any() != meta.name.startswith("norm."), meta.name
    native.close()


@pytest.mark.slow
def test_a_reset_filling_whole_sub_groups_restarts_at_step_0_in_a_real_engine(z3_bf16_dp2, native_resume, tmp_path):
    """embed.weight fills ZeRO-3 sub-groups of its own at sub_group_size 60, so a true reset fits."""
    path = _config(
        tmp_path,
        f"""
source: {json.dumps(str(z3_bf16_dp2.path))}
transforms:
  - reset_optimizer: ["^embed\\\\."]
target: {{dp: 2, output: out}}
""",
    )
    run_migration(path)
    ours = resume(z3_bf16_dp2, LoadSpec(str(tmp_path / "out")), name="reset", work=tmp_path)
    native = native_resume(z3_bf16_dp2)
    assert ours["losses"][0] == native["losses"][0]  # weights untouched
    assert sorted(set(ours["state_steps"])) == [3.0, 6.0]  # the embedding's sub-groups counted from 0
    assert ours["exp_avg"]["embed.weight"].any()
    # a fresh Adam state moves the embedding differently; everything trains on
    assert not torch.equal(ours["params"]["embed.weight"], native["params"]["embed.weight"])


@pytest.mark.slow
def test_a_reset_matching_nothing_is_a_warning(z3_bf16_dp2, tmp_path):
    path = _config(
        tmp_path,
        f"""
source: {json.dumps(str(z3_bf16_dp2.path))}
universal: out
transforms:
  - reset_optimizer: ["^lm_head\\\\."]
""",
    )
    text = run_migration(path, dry_run=True)
    assert f"warning    {path}:5: transforms[0].reset_optimizer[0]: '^lm_head\\\\.' matches no parameter" in text


# -- planning, dry runs, re-runs --------------------------------------------------------------
@pytest.mark.slow
def test_dry_run_lists_the_plan_and_writes_nothing(z3_bf16_dp2, tmp_path):
    path = _config(
        tmp_path,
        f"""
source: {json.dumps(str(z3_bf16_dp2.path))}
universal: out/universal
transforms:
  - rename: {{pattern: "^norm\\\\.", replace: "final_norm."}}
  - drop: ["^proj\\\\."]
  - reset_optimizer: ["^embed\\\\."]
target: {{dp: 3, optimizer: ds-fused-adam, step: reset, output: out/native}}
exports:
  - {{path: out/weights, dtype: fp32}}
""",
    )
    text = run_migration(path, dry_run=True)
    for line in (
        "dry run: nothing is written",
        "tag global_step3, dp=2, bf16, torch-adam",
        "norm.weight -> final_norm.weight",
        "norm.bias -> final_norm.bias",
        "drop proj.weight (param; matches '^proj\\\\.')",
        "reset embed.weight: moments zeroed, step 0",
        f"write      {tmp_path / 'out/universal'}: universal directory",
        f"write      {tmp_path / 'out/native'}: native ZeRO-3 checkpoint for dp=3, ds-fused-adam, bf16",
        "step reset to 0",
        "optimizer state converted from torch-adam to ds-fused-adam",
        f"export     {tmp_path / 'out/weights'}: safetensors, fp32, from the universal directory",
    ):
        assert line in text, line
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_rerun_without_overwrite_refuses_before_writing_anything(z3_bf16_dp2, tmp_path):
    path = _config(
        tmp_path,
        f"""
source: {json.dumps(str(z3_bf16_dp2.path))}
universal: out/universal
target: {{dp: 1, output: out/native}}
""",
    )
    (tmp_path / "out/native").mkdir(parents=True)
    with pytest.raises(OutputExistsError, match=r"m\.yaml:4: target\.output: .*already exists; pass --overwrite"):
        run_migration(path)
    assert not (tmp_path / "out/universal").exists()  # refused before the first output, not at the second
    run_migration(path, overwrite=True)
    assert (tmp_path / "out/native/latest").read_text() == "global_step3"
    assert (tmp_path / "out/universal/ucp.json").is_file()


@pytest.mark.slow
def test_cli_exits_non_zero_with_every_problem(z3_bf16_dp2, tmp_path, capsys):
    path = _config(
        tmp_path,
        f"""
source: {json.dumps(str(z3_bf16_dp2.path))}
target:
  dp: 0
  stage: 4
  output: out
""",
    )
    assert main(["migrate", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "2 problems" in err
    assert f"{path}:4: target.dp: must be a positive integer, got 0" in err
    assert f"{path}:5: target.stage: must be one of 0, 1, 2, 3, got 4" in err


# -- target.format: dcp -----------------------------------------------------------------------
@pytest.mark.slow
def test_a_migration_to_dcp_writes_what_the_source_holds_bit_exact(z3_fp32_dp3, tmp_path):
    """Source -> rename -> reset (step kept) -> DCP, read back by the DCP source: every entry, bit for bit."""
    path = _config(
        tmp_path,
        f"""
source: {json.dumps(str(z3_fp32_dp3.path))}
transforms:
  - rename: {{pattern: "^", replace: "model."}}
  - reset_optimizer: {{params: ["^model\\\\.norm\\\\."], step: keep}}
target: {{format: dcp, output: out/dcp}}
""",
    )
    text = run_migration(path, dry_run=True)
    for line in (
        f"write      {tmp_path / 'out/dcp'}: torch.distributed.checkpoint folder (torch layout) for torch-adamw, fp32, "
        "any world size: model, optim, train_state, lr_scheduler",
        "13 parameters (11 trained, 2 frozen) in 3 param group(s), 1 tied alias(es), 1 buffer(s); 22 optimizer tensors, "
        "step 3",
    ):
        assert line in text, (line, text)
    assert not (tmp_path / "out").exists()
    assert "wrote a torch.distributed.checkpoint folder (torch-adamw, torch layout)" in run_migration(path)
    with open_reader(z3_fp32_dp3.path) as src, DcpSource(tmp_path / "out/dcp") as out:
        assert [(f"model.{p.name}", p.shape, p.group, p.frozen) for p in src.facts.params] == [
            (p.name, p.shape, p.group, p.frozen) for p in out.facts.params
        ]
        assert out.facts.tied == {"model.head.weight": "model.embed.weight"} and out.facts.buffer_names == [
            "model.calls"
        ]
        assert [g.hyper.lr for g in out.facts.groups] == [g.hyper.lr for g in src.facts.groups]
        for meta in src.facts.params:
            theirs, ours = src.read(meta.name), out.read(f"model.{meta.name}")
            assert torch.equal(ours.fp32, theirs.fp32) and ours.step == theirs.step, meta.name
            for key, value in theirs.optim.items():
                want = torch.zeros_like(value) if meta.name.startswith("norm.") else value
                assert torch.equal(ours.optim[key], want), (meta.name, key)
        assert torch.equal(out.buffers()["model.calls"], src.buffers()["calls"])
        assert out.extras()["lr_scheduler"] == src.extras()["lr_scheduler"]
        assert out.facts.info.global_steps == src.facts.info.global_steps == 3


@pytest.mark.slow
def test_a_dcp_target_keeps_each_parameters_own_step_after_a_reset(z3_fp32_dp3, tmp_path):
    """torch keeps one step per parameter: a reset restarts only the parameters it names."""
    import torch.distributed.checkpoint as dcp

    path = _config(
        tmp_path,
        f"""
source: {json.dumps(str(z3_fp32_dp3.path))}
transforms:
  - reset_optimizer: ["^norm\\\\."]
target: {{format: dcp, output: out}}
""",
    )
    assert "steps [0, 3]" in run_migration(path, dry_run=True)
    run_migration(path)
    names = [p.name for p in open_reader(z3_fp32_dp3.path).facts.params if not p.frozen]
    steps = {f"optim.state.{n}.step": torch.tensor(-1.0) for n in names}
    dcp.load(steps, checkpoint_id=tmp_path / "out", no_dist=True)
    assert {k.split(".")[2]: v.item() for k, v in steps.items() if v.item() == 0} == {"norm": 0.0}
    assert sorted({v.item() for v in steps.values()}) == [0.0, 3.0]


# -- bad configs, case by case ----------------------------------------------------------------
BAD = [
    (
        "unknown top-level key",
        "{src}\nuniversal: out\ntarj: {{dp: 2}}\n",
        ["m.yaml:3: tarj: unknown key; did you mean 'target'?"],
    ),
    (
        "unknown nested key",
        "{src}\ntarget:\n  dp: 2\n  output: out\n  ouptut: x\n",
        ["m.yaml:5: target.ouptut: unknown key; did you mean 'output'?"],
    ),
    (
        "wrong type",
        "{src}\ntarget:\n  dp: four\n  output: out\n",
        ["m.yaml:3: target.dp: must be an integer, got 'four' (str)"],
    ),
    (
        "bool is not an int",
        "{src}\ntarget: {{dp: true, output: out}}\n",
        ["m.yaml:2: target.dp: must be an integer, got True (a boolean)"],
    ),
    ("dp 0", "{src}\ntarget: {{dp: 0, output: out}}\n", ["m.yaml:2: target.dp: must be a positive integer, got 0"]),
    (
        "stage 4",
        "{src}\ntarget:\n  dp: 2\n  stage: 4\n  output: out\n",
        ["m.yaml:4: target.stage: must be one of 0, 1, 2, 3, got 4"],
    ),
    (
        "unknown optimizer",
        "{src}\ntarget:\n  dp: 2\n  optimizer: adamw\n  output: out\n",
        [
            "m.yaml:4: target.optimizer: must be one of torch-adam, ds-fused-adam, ds-cpu-adam, apex-fused-adam, "
            "torch-sgd, torch-rmsprop, torch-nadam, torch-radam, torch-adamax, torch-adagrad, torch-adadelta, "
            "torch-rprop, torch-asgd, torch-adafactor, hf-adafactor, sf-adamw, sf-radam, sf-sgd, ds-cpu-adagrad, ds-lion, "
            "ds-muon, ds-muon-torch-adam, torch-adamw, got 'adamw' (did you mean 'sf-adamw' or 'torch-adamw'?)"
        ],
    ),
    (
        "torch-adamw for a native target",
        "{src}\ntarget:\n  dp: 2\n  optimizer: torch-adamw\n  output: out\n",
        [
            "m.yaml:4: target.optimizer: torch-adamw names a dcp output's optimizer; a native checkpoint takes torch-adam"
        ],
    ),
    ("native target without dp", "{src}\ntarget: {{output: out}}\n", ["m.yaml:2: target.dp: is required"]),
    (
        "dcp target with native options",
        "{src}\ntarget:\n  format: dcp\n  dp: 2\n  tp: 2\n  output: out\n",
        ["m.yaml:4: target.dp: does not apply to format dcp", "m.yaml:5: target.tp: does not apply to format dcp"],
    ),
    (
        "dcp target for a DeepSpeed optimizer",
        "{src}\ntarget: {{format: dcp, optimizer: ds-fused-adam, output: out}}\n",
        ["m.yaml:2: target.optimizer: a dcp output is read by a torch optimizer: one of torch-adamw, torch-adam"],
    ),
    (
        "dcp target for another optimizer family",
        "{src}\ntarget: {{format: dcp, optimizer: torch-sgd, output: out}}\n",
        ["m.yaml:2: target.optimizer:", "adam family"],
    ),
    (
        "dcp layout on a native target",
        "{src}\ntarget: {{dp: 2, layout: torchtitan, output: out}}\n",
        ["m.yaml:2: target.layout: describes a dcp output"],
    ),
    (
        "unknown dtype",
        "{src}\ntarget:\n  dp: 2\n  dtype: fp8\n  output: out\n",
        ["m.yaml:4: target.dtype: must be one of fp32, bf16, fp16, got 'fp8'"],
    ),
    (
        "bad step",
        "{src}\ntarget:\n  dp: 2\n  step: -1\n  output: out\n",
        ["m.yaml:4: target.step: must be keep, reset or a non-negative integer, got -1"],
    ),
    ("missing output", "{src}\ntarget:\n  dp: 2\n", ["m.yaml:2: target.output: is required"]),
    (
        "unknown export format",
        "{src}\nexports:\n  - {{format: onnx, path: w}}\n",
        ["m.yaml:3: exports[0].format: must be one of safetensors, torch, got 'onnx'"],
    ),
    (
        "export file of the other format",
        "{src}\nexports:\n  - format: torch\n    path: w.safetensors\n",
        ["m.yaml:4: exports[0].path: w.safetensors does not fit format torch"],
    ),
    (
        "bad shard size",
        "{src}\nexports:\n  - {{path: w, max_shard_size: huge}}\n",
        ["m.yaml:3: exports[0].max_shard_size: must be a size such as 500MB or 5GB, got 'huge'"],
    ),
    (
        "regex that does not compile",
        '{src}\nuniversal: out\ntransforms:\n  - drop: ["ok", "(open"]\n',
        ["m.yaml:4: transforms[0].drop[1]: '(open' is not a valid regular expression: missing )"],
    ),
    (
        "rename regex that does not compile",
        '{src}\nuniversal: out\ntransforms:\n  - rename:\n      pattern: "["\n      replace: x\n',
        ["m.yaml:5: transforms[0].rename.pattern: '[' is not a valid regular expression"],
    ),
    (
        "rename back-reference to no group",
        '{src}\nuniversal: out\ntransforms:\n  - rename: {{pattern: "^embed", replace: "\\\\2"}}\n',
        ["m.yaml:4: transforms[0].rename.replace: cannot be applied to 'embed.weight': invalid group reference 2"],
    ),
    (
        "rename collision",
        '{src}\nuniversal: out\ntransforms:\n  - rename: {{pattern: "\\\\.(weight|bias)$", replace: ""}}\n',
        ["m.yaml:4: transforms[0].rename: 'blocks.0.0.weight' and 'blocks.0.0.bias' would both be named 'blocks.0.0'"],
    ),
    (
        "rename onto an existing name",
        '{src}\nuniversal: out\ntransforms:\n  - rename: {{pattern: "^norm\\\\.bias$", replace: norm.weight}}\n',
        ["m.yaml:4: transforms[0].rename: 'norm.weight' and 'norm.bias' would both be named 'norm.weight'"],
    ),
    (
        "drop every parameter",
        '{src}\nuniversal: out\ntransforms:\n  - drop: ["^(embed|blocks)\\\\."]\n  - drop: [""]\n',
        ["m.yaml:5: transforms[1].drop: drops every parameter; nothing would be left to write"],
    ),
    (
        "two kinds in one item",
        "{src}\nuniversal: out\ntransforms:\n  - drop: [a]\n    reset_optimizer: [b]\n",
        ["m.yaml:4: transforms[0]: holds drop and reset_optimizer; give each transform its own list item"],
    ),
    (
        "empty pattern list",
        "{src}\nuniversal: out\ntransforms:\n  - drop: []\n",
        ["m.yaml:4: transforms[0].drop: must list at least one regular expression"],
    ),
    (
        "a pattern that is not a list",
        '{src}\nuniversal: out\ntransforms:\n  - reset_optimizer: "^embed"\n',
        [
            "m.yaml:4: transforms[0].reset_optimizer: must be a list of strings or a mapping with keys params, step, "
            "got '^embed' (str)"
        ],
    ),
    (
        "reset in full, badly",
        '{src}\nuniversal: out\ntransforms:\n  - reset_optimizer:\n      params: ["(x"]\n      step: later\n',
        [
            "m.yaml:5: transforms[0].reset_optimizer.params[0]: '(x' is not a valid regular expression",
            "m.yaml:6: transforms[0].reset_optimizer.step: must be one of zero, keep, got 'later'",
        ],
    ),
    ("missing source", "universal: out\n", ["m.yaml: source: is required"]),
    (
        "source that is no checkpoint",
        "source: nowhere\nuniversal: out\n",
        ["m.yaml:1: source: cannot be read:", "nowhere does not exist"],
    ),
    (
        "unknown tag",
        "{src}\ntag: global_step9\nuniversal: out\n",
        ["m.yaml:2: tag: cannot be read: tag 'global_step9' not found"],
    ),
    ("nothing to write", "{src}\n", ["m.yaml: nothing to write: give universal, target or exports"]),
    ("output inside the source", "{src}\nuniversal: {inside}\n", ["m.yaml:2: universal:", "overlaps the source"]),
    (
        "two outputs on one path",
        "{src}\nuniversal: out\ntarget: {{dp: 2, output: out}}\n",
        ["m.yaml:3: target.output:", "is also universal; every output needs its own path"],
    ),
    ("duplicate key", "{src}\nuniversal: out\nuniversal: other\n", ["m.yaml:3: universal: is given twice"]),
    ("not YAML", "{src}\ntarget: [dp: 2\n", ["m.yaml:3: not valid YAML"]),
    ("not a mapping", "- source\n", ["m.yaml: the config is a list, not a mapping"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, body, expected", BAD, ids=[case for case, _, _ in BAD])
def test_bad_config_is_refused_with_key_path_and_line(case, body, expected, z3_bf16_dp2, tmp_path):
    src = f"source: {json.dumps(str(z3_bf16_dp2.path))}"
    inside = json.dumps(str(z3_bf16_dp2.path / "inside"))
    path = _config(tmp_path, body.format(src=src, inside=inside))
    message = _problems(path)
    for fragment in expected:
        assert fragment in message, (fragment, message)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_every_problem_is_reported_at_once(z3_bf16_dp2, tmp_path):
    """Config problems and what the checkpoint shows (a collision) come in one error, by line."""
    path = _config(
        tmp_path,
        f"""source: {json.dumps(str(z3_bf16_dp2.path))}
universal: out
transforms:
  - rename: {{pattern: "^blocks\\\\.\\\\d+\\\\.", replace: "b."}}
  - reset_optimizer: ["(bad"]
target:
  dp: 0
  optimizer: adamw
  outptu: x
""",
    )
    with pytest.raises(MigrationConfigError) as caught:
        run_migration(path, dry_run=True)
    problems = caught.value.problems
    assert [int(p.split(":")[1]) for p in problems] == sorted(int(p.split(":")[1]) for p in problems)
    text = "\n".join(problems)
    for fragment in (
        "m.yaml:5: transforms[1].reset_optimizer[0]: '(bad' is not a valid regular expression",
        "m.yaml:6: target.output: is required",
        "m.yaml:7: target.dp: must be a positive integer",
        "m.yaml:8: target.optimizer: must be one of",
        "m.yaml:9: target.outptu: unknown key",
    ):
        assert fragment in text, (fragment, text)
    # a transform list with a bad step is not applied, so no collision is reported for it; fix the
    # regex and the collision shows up together with the target's problems
    path.write_text(path.read_text().replace('["(bad"]', '["^embed"]'))
    text = "\n".join(_problems(path).splitlines())
    assert "m.yaml:4: transforms[0].rename: 'blocks.0.0.weight' and 'blocks.1.0.weight' would both be named" in text
    assert "m.yaml:7: target.dp: must be a positive integer" in text


@pytest.mark.slow
def test_relative_paths_resolve_against_the_config_folder(z3_bf16_dp2, tmp_path, monkeypatch):
    shutil.copytree(z3_bf16_dp2.path, tmp_path / "ckpt")
    (tmp_path / "configs").mkdir()
    path = _config(tmp_path / "configs", "source: ../ckpt\nuniversal: ../out/universal\n")
    monkeypatch.chdir("/")
    run_migration(path)
    assert (tmp_path / "out/universal/ucp.json").is_file()


# -- target.pipeline: a PipelineEngine checkpoint ---------------------------------------------
@pytest.fixture(scope="module")
def pipe_universal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The universal directory of the real PP=2 x DP=2 PipelineModule run (tests/test_pipeline.py)."""
    from tests.support.pipeline_runs import build_pipe
    from ucp.ops.convert import to_universal

    out = tmp_path_factory.mktemp("pipe") / "u"
    to_universal(build_pipe(pp=2, dp=2, stage=1, dtype="fp32").path, out)
    return out


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_pipeline_target_writes_what_ucp_restore_pp_writes_byte_for_byte(pipe_universal, tmp_path):
    """The same partition in YAML and on the command line: the same files, byte for byte (the CLI's output
    loads into a PipelineEngine, tests/test_pipeline.py), ZeRO-1 unless told."""
    path = _config(
        tmp_path,
        f"""
source: {json.dumps(str(pipe_universal))}
target:
  dp: 1
  output: yaml
  pipeline: {{parts: [0, 3, 6], tied: {{embed: [0, 5]}}}}
""",
    )
    plan = run_migration(path, dry_run=True)
    assert "native pipeline (parts [0, 3, 6], tied {'embed': [0, 5]}) ZeRO-1 checkpoint for dp=1 x pp=2" in plan
    assert not (tmp_path / "yaml").exists()
    assert "wrote a pipeline checkpoint for pp=2 x dp=1 (ZeRO-1" in run_migration(path)
    argv = ["-q", "restore", str(pipe_universal), str(tmp_path / "cli"), "--pp", "2", "--dp", "1"]
    assert main([*argv, "--pp-parts", "0,3,6", "--pp-tied", "embed=0,5"]) == 0
    ours, theirs = _files(tmp_path / "yaml"), _files(tmp_path / "cli")
    assert any(name.endswith("layer_05-model_states.pt") for name in ours)
    assert ours == theirs


@pytest.mark.slow
def test_a_pipeline_target_cut_by_partition_method_is_the_clis(pipe_universal, tmp_path):
    """``partition: parameters`` with stages and layers: the parts DeepSpeed's method makes ([0, 2, 3, 6] for 3
    stages, tests/test_pipeline.py), the same files as ``ucp restore --pp 3 --pp-partition parameters``."""
    body = f"""
source: {json.dumps(str(pipe_universal))}
target:
  dp: 1
  output: yaml
  pipeline: {{partition: parameters, stages: 3, layers: 6, tied: {{embed: [0, 5]}}}}
"""
    path = _config(tmp_path, body)
    assert "native pipeline (parameters partition of 6 layers, tied {'embed': [0, 5]})" in run_migration(
        path, dry_run=True
    )
    assert "wrote a pipeline checkpoint for pp=3 x dp=1 (ZeRO-1" in run_migration(path)
    argv = [
        "-q",
        "restore",
        str(pipe_universal),
        str(tmp_path / "cli"),
        "--pp",
        "3",
        "--dp",
        "1",
        "--pp-tied",
        "embed=0,5",
    ]
    assert main([*argv, "--pp-partition", "parameters", "--pp-layers", "6"]) == 0
    assert main([*argv[:3], str(tmp_path / "parts"), *argv[4:], "--pp-parts", "0,2,3,6"]) == 0
    assert _files(tmp_path / "yaml") == _files(tmp_path / "cli") == _files(tmp_path / "parts")


PIPELINE_BAD = [
    ("parts not rising", "pipeline: {parts: [0, 3, 3], tied: {embed: [0, 5]}}", r"target\.pipeline\.parts: layer partition \[0, 3, 3\] is not one"),
    ("parts as a string", "pipeline: {parts: '0,3,6'}", r"target\.pipeline\.parts: must be a list of integers, got '0,3,6'"),
    ("parts missing", "pipeline: {tied: {embed: [0, 5]}}", r"target\.pipeline\.parts: give the layer partition \(parts: \[0, 3, 6\]\) or a partition method"),
    ("parts and a method", "pipeline: {parts: [0, 3, 6], partition: uniform}", r"target\.pipeline\.parts: give the layer partition .*: one of them"),
    ("unknown method", "pipeline: {partition: 'type:PipeBlock', stages: 2, layers: 6}", r"target\.pipeline\.partition: must be one of uniform, parameters"),
    ("method without layers", "pipeline: {partition: uniform, stages: 2}", r"target\.pipeline\.layers: partition: uniform needs layers"),
    ("too few layers", "pipeline: {partition: uniform, stages: 7, layers: 6, tied: {embed: [0, 5]}}", r"target\.pipeline: 6 layers cannot fill 7 pipeline stages"),
    ("tied not a mapping of lists", "pipeline: {parts: [0, 3, 6], tied: {embed: 5}}", r"target\.pipeline\.tied: must be a mapping of strings to a list of integers"),
    ("tied without layers", "pipeline: {parts: [0, 3, 6], tied: {embed: []}}", r"target\.pipeline\.tied: tied module 'embed' needs the indices"),
    ("tied key missing", "pipeline: {parts: [0, 3, 6]}", r"target\.pipeline: tied_modules\.embed\.weight belongs to tied module 'embed'"),
    ("layer outside the partition", "pipeline: {parts: [0, 3, 5], tied: {embed: [0, 5]}}", r"target\.pipeline: layer 5 is outside the partition \[0, 3, 5\]"),
    ("stage 2", "stage: 2\n  pipeline: {parts: [0, 3, 6], tied: {embed: [0, 5]}}", r"target\.stage: a pipeline target is ZeRO-1 \(PipelineEngine refuses ZeRO-2/3\)"),
    ("tp 2 without rules", "tp: 2\n  pipeline: {parts: [0, 3, 6], tied: {embed: [0, 5]}}", r"target\.tp: no tensor-parallel rule for 'tied_modules\.embed\.weight'"),
    ("dcp", "format: dcp\n  pipeline: {parts: [0, 3, 6]}", r"target\.pipeline: does not apply to format dcp"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case, section, message", PIPELINE_BAD, ids=[case for case, _, _ in PIPELINE_BAD])
def test_a_bad_pipeline_target_is_one_line_and_writes_nothing(case, section, message, pipe_universal, tmp_path, capsys):
    dp = "" if "dcp" in section else "dp: 1\n  "
    body = f"source: {json.dumps(str(pipe_universal))}\ntarget:\n  {dp}output: out\n  {section}\n"
    assert main(["migrate", str(_config(tmp_path, body))]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_pipeline_target_refuses_a_mixture_of_experts_source(tmp_path, capsys):
    from tests.support.moe_runs import build_moe

    moe = build_moe(world=4, ep=2, experts=4, stage=2, dtype="fp32")
    body = f"source: {json.dumps(str(moe.path))}\ntarget:\n  dp: 2\n  output: out\n  pipeline: {{parts: [0, 2]}}\n"
    assert main(["migrate", str(_config(tmp_path, body))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("target.pipeline: the source is a mixture-of-experts run, which a pipeline target cannot "
                        "write; remove pipeline"), err  # fmt: skip
    assert not (tmp_path / "out").exists()
