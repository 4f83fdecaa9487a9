"""Megatron-Core torch_dist checkpoints with the distributed optimizer's state: read by ucp bit for bit against the
live optimizer, written for Megatron to resume at another TP / PP / DP (even from dp_reshardable state, which
Megatron-LM refuses to move), and across the border to and from a Hugging Face Llama run under DeepSpeed.

The runs are real (tests/support/megatron_worker.py: megatron-core 0.16.1 on gloo CPU ranks, the tiny Llama-like
GPT, fp32; tests/support/hf_worker.py: Trainer + DeepSpeed ZeRO-3, fp32).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from tests.support.megatron_runs import (  # noqa: E402
    LOSS_TOL,
    SAVED_AT,
    TOTAL,
    cached_run,
    checkpoint_key,
    forward_backward,
    resume_at,
    save_spec,
)
from ucp.cli import main  # noqa: E402
from ucp.errors import UcpError  # noqa: E402
from ucp.frameworks.megatron import layer_name  # noqa: E402
from ucp.sources import open_reader  # noqa: E402
from ucp.targets.megatron import write_megatron  # noqa: E402

pytestmark = pytest.mark.slow

_MOMENTS = ("fp32", "exp_avg", "exp_avg_sq")
#: the save runs: name -> (tp, pp, dp, sharding, extra spec fields)
SAVES: dict[str, tuple[int, int, int, str, dict[str, Any]]] = {
    "tp1dp2-dpr": (1, 1, 2, "dp_reshardable", {}),
    "tp1dp2-fr": (1, 1, 2, "fully_reshardable", {}),
    "tp2dp1-fr": (2, 1, 1, "fully_reshardable", {}),
    "tp2dp1-dpr": (2, 1, 1, "dp_reshardable", {}),
    "pp2dp1-dpr": (1, 2, 1, "dp_reshardable", {}),
    "odd-dp3-dpr": (1, 1, 3, "dp_reshardable", {"odd": True, "global_batch": 6}),
}


def _saved(name: str) -> Any:
    tp, pp, dp, sharding, extra = SAVES[name]
    return cached_run(name, save_spec(tp, pp, dp, sharding, **extra))


def _ucp_name(name: str) -> str:
    key, layer = checkpoint_key(name)
    return key if layer is None else layer_name(key, layer)


def _read(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    with open_reader(folder) as reader:
        out = {}
        for meta in reader.facts.params:
            state = reader.read(meta.name)
            out[meta.name] = {"fp32": state.fp32, **state.optim}
        return out


@pytest.mark.parametrize("name", list(SAVES))
def test_megatron_checkpoint_reads_what_the_live_optimizer_held(name: str) -> None:
    """Every fp32 master, exp_avg and exp_avg_sq as the live DistributedOptimizer held it at the save, bit for bit,
    the step and the groups, for both sharding types at DP 2 and 3 (odd sizes: padding inside the buckets), TP 2
    and PP 2."""
    run = _saved(name)
    live = run.saved()
    with open_reader(run.out) as reader:
        facts = reader.facts
        assert reader.format == "megatron" and facts.megatron is not None
        assert facts.megatron.sharding == SAVES[name][3]
        assert (facts.megatron.tp, facts.megatron.pp, facts.megatron.dp) == SAVES[name][:3]
        assert facts.step == SAVED_AT and facts.info.global_steps == SAVED_AT
        assert facts.flavour == "torch-adam" and facts.adam_w_mode is True
        group_of = {m.name: m.group for m in facts.params}
    got = _read(run.out)
    assert set(got) == {_ucp_name(n) for n in live["state"]}
    for module_name, tensors in live["state"].items():
        mine = got[_ucp_name(module_name)]
        for key in _MOMENTS:
            assert torch.equal(mine[key], tensors[key]), f"{module_name} {key}"
        assert group_of[_ucp_name(module_name)] == live["group"][module_name]
    assert {float(s) for s in live["steps"].values()} == {float(SAVED_AT)}


#: (save run, resume layout): across DP, TP and PP, from both sharding types
REWRITES = [
    ("tp1dp2-dpr", (2, 1, 1)),
    ("tp1dp2-dpr", (1, 2, 1)),
    ("tp2dp1-dpr", (1, 1, 2)),
    ("odd-dp3-dpr", (1, 1, 1)),
    ("tp1dp2-fr", (2, 1, 1)),
]


@pytest.mark.parametrize(("name", "layout"), REWRITES, ids=[f"{n}-to-tp{t}pp{p}dp{d}" for n, (t, p, d) in REWRITES])
def test_written_checkpoint_resumes_at_another_layout(name: str, layout: tuple[int, int, int], tmp_path: Path) -> None:
    """ucp's fully_reshardable folder, loaded by Megatron at another TP / PP / DP: the state Megatron holds after
    the load is the saved one bit for bit, and 3 more steps give the uninterrupted run's losses (Megatron-LM itself
    refuses a TP or PP change of dp_reshardable state)."""
    run = _saved(name)
    out = tmp_path / "moved"
    plan = write_megatron(run.out, out)
    assert (out / "latest_checkpointed_iteration.txt").read_text() == str(SAVED_AT)
    extra = {k: v for k, v in SAVES[name][4].items() if k in ("odd", "global_batch")}
    back = resume_at(out, *layout, work=tmp_path, name="resume", steps=TOTAL - SAVED_AT, **extra)
    loaded, want = back.loaded(), run.saved()
    assert loaded["iteration"] == SAVED_AT and loaded["sharding"] == "fully_reshardable"
    assert loaded["rng_loaded"] == (layout[:2] == SAVES[name][:2])
    for module_name, tensors in want["state"].items():
        for key in _MOMENTS:
            assert torch.equal(loaded["state"][module_name][key], tensors[key]), f"{module_name} {key}"
    assert {float(s) for s in loaded["steps"].values()} == {float(SAVED_AT)}
    final, ref = back.final(), run.final()
    for step, loss in final["losses"].items():
        assert abs(loss - ref["losses"][step]) <= LOSS_TOL, (step, loss, ref["losses"][step])
    assert plan.tp == SAVES[name][0]


def test_inspect_and_diff_read_the_folder(tmp_path: Path, capsys: Any) -> None:
    run = _saved("tp1dp2-dpr")
    assert main(["inspect", str(run.out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["format"] == "megatron" and report["megatron"]["sharding"] == "dp_reshardable"
    out = tmp_path / "fr"
    assert main(["restore", str(run.out), str(out), "--format", "megatron", "-q"]) == 0
    assert main(["diff", str(run.out), str(out), "-q"]) == 0
    assert main(["restore", str(run.out), str(tmp_path / "x"), "--format", "megatron", "--tp", "2"]) != 0
    assert "does not apply to --format megatron" in capsys.readouterr().err
    config = tmp_path / "move.yaml"
    config.write_text(f"source: {run.out}\ntarget:\n  format: megatron\n  output: {tmp_path / 'migrated'}\n")
    assert main(["migrate", str(config), "--dry-run"]) == 0
    assert "optimizer state fully_reshardable" in capsys.readouterr().out
    assert main(["migrate", str(config), "-q"]) == 0
    assert main(["diff", str(run.out), str(tmp_path / "migrated"), "-q"]) == 0


# -- across the border: a Hugging Face Llama run under DeepSpeed ---------------------------------------------------
def _trainer_ckpt() -> Path:
    from tests.support.hf_runs import SAVED_AT as HF_SAVED_AT
    from tests.support.hf_runs import cached_run as hf_run
    from tests.support.hf_worker import HfSpec

    saved = hf_run("trainer-z3-fp32-save", HfSpec(world=2, stage=3, extra={"fp32": True}))
    return saved.out / f"checkpoint-{HF_SAVED_AT}"


def _model(config: dict[str, Any]) -> dict[str, Any]:
    """The Megatron harness's model dict for a Hugging Face Llama config."""
    return {
        "num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
        "ffn_hidden_size": config["intermediate_size"], "num_attention_heads": config["num_attention_heads"],
        "num_query_groups": config["num_key_value_heads"],
        "kv_channels": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        "vocab_size": config["vocab_size"], "seq_length": 16, "rotary_base": config.get("rope_theta", 10000.0),
        "layernorm_epsilon": config["rms_norm_eps"],
    }  # fmt: skip


def test_deepspeed_llama_run_crosses_into_megatron_and_back(tmp_path: Path) -> None:
    """A Trainer ZeRO-3 run of a Llama (fp32) written as Megatron-Core: after Megatron's load, every weight and
    optimizer state tensor equals the DeepSpeed checkpoint's, mapped by the reference mapping (not ucp's), bit for
    bit; one batch gives Megatron the loss Hugging Face's LlamaForCausalLM gives on the DeepSpeed weights; written
    back as DeepSpeed, it is the source bit for bit."""
    from tests.support.megatron_hf import hf_loss, megatron_from_hf

    ckpt = _trainer_ckpt()
    config = json.loads((ckpt / "config.json").read_text())
    model = _model(config)
    out = tmp_path / "megatron"
    assert main(["restore", str(ckpt), str(out), "--format", "megatron", "-q"]) == 0
    source = {}
    with open_reader(ckpt) as reader:
        for meta in reader.facts.params:
            state = reader.read(meta.name)
            source[meta.name] = {"fp32": state.fp32, **state.optim}
    want = {key: megatron_from_hf({n: t[key] for n, t in source.items()}, model) for key in _MOMENTS}
    fields = {"model": {"layernorm_epsilon": model["layernorm_epsilon"]}}
    back = resume_at(out, 1, 1, 1, work=tmp_path, name="load", steps=0, **fields)
    loaded = back.loaded()
    step = int(ckpt.name.split("-")[1])
    assert loaded["iteration"] == step
    assert set(loaded["state"]) == set(want["fp32"])
    for name, tensors in loaded["state"].items():
        for key in _MOMENTS:
            assert torch.equal(tensors[key], want[key][name]), f"{name} {key}"
    assert {float(s) for s in loaded["steps"].values()} == {float(step)}

    generator = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, config["vocab_size"], (2, model["seq_length"] + 1), generator=generator)
    probe = forward_backward(tokens[:, :-1], tokens[:, 1:], work=tmp_path, resume=str(out), **fields)
    weights = {n: t["fp32"] for n, t in source.items()}
    loss, _ = hf_loss(model, weights, tokens[:, :-1], tokens[:, 1:])
    assert abs(probe["loss"] - loss) <= 1e-5, (probe["loss"], loss)

    again = tmp_path / "deepspeed"
    assert main(["restore", str(out), str(again), "--dp", "2", "--stage", "3", "-q"]) == 0
    assert main(["diff", str(ckpt), str(again), "-q"]) == 0


def test_megatron_run_exports_a_hugging_face_llama(tmp_path: Path) -> None:
    """ucp export of a Megatron checkpoint: a folder LlamaForCausalLM loads, whose loss on a batch is Megatron's."""
    from transformers import LlamaForCausalLM

    run = _saved("tp2dp1-fr")
    out = tmp_path / "hf"
    assert main(["export", str(run.out), str(out), "-q"]) == 0
    llama = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    from tests.support.megatron_model import DEFAULT

    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, DEFAULT["vocab_size"], (2, DEFAULT["seq_length"] + 1), generator=generator)
    probe = forward_backward(tokens[:, :-1], tokens[:, 1:], work=tmp_path, resume=str(run.out))
    logits = llama(input_ids=tokens[:, :-1]).logits.float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert abs(float(loss.detach()) - probe["loss"]) <= 1e-5, (float(loss.detach()), probe["loss"])


def test_a_llama_without_its_config_is_refused_in_one_line(tmp_path: Path, capsys: Any) -> None:
    from tests.support.fixtures import build

    plain = build(dp=2, stage=3, dtype="bf16", optimizer="torch-adamw", sub_group_size=60).path
    assert main(["restore", str(plain), str(tmp_path / "o"), "--format", "megatron"]) != 0
    assert "needs its Hugging Face config.json" in capsys.readouterr().err
    with pytest.raises(UcpError):
        write_megatron(plain, tmp_path / "o2")
