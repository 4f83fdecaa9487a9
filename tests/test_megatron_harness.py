"""The Megatron-Core harness (tests/support/megatron_*.py) against real megatron-core 0.16.1 runs on gloo ranks.

Saves at (tp1, dp2) with both optimizer sharding types and at (tp2, dp1) fully_reshardable: the folder is laid
out like Megatron-LM's, the records hold what the checkpoint holds (read back with torch's DCP reader, no
megatron), and Megatron's own resume gives the saved state bit for bit and continues the uninterrupted run's
losses. The Hugging Face Llama twin of the model (tests/support/megatron_hf.py) gives Megatron's loss.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

if importlib.util.find_spec("megatron.core") is None:  # not importorskip: importing megatron.core registers
    pytest.skip("megatron-core is not installed", allow_module_level=True)  # safe globals process-wide

from tests.support.megatron_hf import hf_from_megatron, hf_loss, megatron_from_hf  # noqa: E402
from tests.support.megatron_runs import (  # noqa: E402
    LOSS_TOL,
    SAVED_AT,
    TOTAL,
    MegatronRun,
    cached_run,
    checkpoint_key,
    forward_backward,
    read_common,
    resume_at,
    save_spec,
)
from ucp.harness.launch import RankFailure  # noqa: E402

pytestmark = pytest.mark.slow

#: the save runs: name -> (tp, pp, dp, sharding)
SAVES = {
    "tp1dp2-dpr": (1, 1, 2, "dp_reshardable"),
    "tp1dp2-fr": (1, 1, 2, "fully_reshardable"),
    "tp2dp1-fr": (2, 1, 1, "fully_reshardable"),
}
_MOMENTS = ("fp32", "exp_avg", "exp_avg_sq")
#: model fields of Megatron-LM's args that common.pt must carry (what load_args_from_checkpoint reads)
_ARGS = dict(
    num_layers=2,
    hidden_size=64,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    group_query_attention=True,
    kv_channels=16,
    padded_vocab_size=128,
    normalization="RMSNorm",
    swiglu=True,
    untie_embeddings_and_output_weights=True,
    position_embedding_type="rope",
    rotary_base=10000,
    add_bias_linear=False,
    params_dtype=torch.float32,
    attention_backend="AttnBackend.auto",  # an enum (read_common gives its str): real args hold megatron classes
)


def saved_run(name: str) -> MegatronRun:
    return cached_run(name, save_spec(*SAVES[name]))


def _dcp_tensors(folder: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """Global tensors of ``keys`` read with torch's own DCP reader, single process (no megatron)."""
    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    state = {key: torch.empty(tuple(metadata[key].size), dtype=metadata[key].properties.dtype) for key in keys}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": single process on purpose
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=True)
    return state


def _on_disk(state: dict[str, torch.Tensor], key: str, layer: int | None) -> torch.Tensor:
    return state[key] if layer is None else state[key][layer]


@pytest.mark.parametrize("name", list(SAVES))
def test_save_is_laid_out_like_megatron_lm(name: str) -> None:
    tp, pp, dp, sharding = SAVES[name]
    run = saved_run(name)
    folder = run.iteration_dir()
    assert run.latest() == SAVED_AT and folder.name == f"iter_{SAVED_AT:07d}"
    assert json.loads((folder / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
        "common_backend": "torch",
        "common_backend_version": 1,
    }
    assert {p.name for p in folder.glob("*.distcp")} == {
        f"__{r}_{t}.distcp" for r in range(tp * pp * dp) for t in (0, 1)
    }
    common = read_common(folder)  # weights_only=True with megatron's safe globals: how Megatron reads it
    args = common["args"]
    assert {k: args[k] for k in _ARGS} == _ARGS
    layout = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp)
    layout |= dict(world_size=tp * pp * dp, iteration=SAVED_AT)
    layout |= dict(dist_ckpt_optim_fully_reshardable=sharding == "fully_reshardable")
    assert {k: args[k] for k in layout} == layout
    assert (common["iteration"], common["checkpoint_version"]) == (SAVED_AT, 3.0)
    assert common["content_metadata"]["distrib_optim_sharding_type"] == sharding
    assert common["optimizer"]["param_state_sharding_type"] == sharding
    assert common["opt_param_scheduler"]["num_steps"] == SAVED_AT * 4  # samples
    assert ("optimizer" in common["optimizer"]) == (sharding == "fully_reshardable")  # its param groups


@pytest.mark.parametrize("name", list(SAVES))
def test_records_hold_what_the_checkpoint_holds(name: str) -> None:
    """saved_3.pt, in the TP-invariant layout, is what the checkpoint stores, bit for bit: the model tensors
    (and the fully_reshardable moments) read back by key and layer; dp_reshardable's flat bucket holds the
    record's params in reverse ``named_parameters()`` order (the record's order), each 64-aligned."""
    tp, pp, dp, sharding = SAVES[name]
    run = saved_run(name)
    saved, final = run.saved(), run.final()
    assert saved["iteration"] == SAVED_AT and set(saved["steps"].values()) == {float(SAVED_AT)}
    assert saved["losses"] == {s: final["losses"][s] for s in range(SAVED_AT)} and len(final["losses"]) == TOTAL
    assert saved["layer"]["decoder.layers.1.mlp.linear_fc2.weight"] == 1
    assert saved["layer"]["output_layer.weight"] is None
    assert saved["group"].keys() == saved["state"].keys()
    for param, group in saved["group"].items():  # 1-D norms in the no-weight-decay group
        assert saved["param_groups"][group]["wd_mult"] == (0.0 if saved["state"][param]["fp32"].dim() == 1 else 1.0)
    metadata = dcp.FileSystemReader(str(run.iteration_dir())).read_metadata()
    kinds = {"fp32": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    keys = {checkpoint_key(n)[0] for n in saved["state"]}
    if sharding == "fully_reshardable":
        keys |= {f"optimizer.state.{kind}.{key}" for key in set(keys) for kind in kinds.values()}
    disk = _dcp_tensors(run.iteration_dir(), sorted(keys))
    assert saved["state"]["decoder.layers.0.self_attention.linear_qkv.weight"]["fp32"].shape == (128, 64)
    for param, tensors in saved["state"].items():
        key, layer = checkpoint_key(param)
        assert torch.equal(_on_disk(disk, key, layer), tensors["fp32"]), param
        if sharding == "fully_reshardable":
            for field, kind in kinds.items():
                on_disk = _on_disk(disk, f"optimizer.state.{kind}.{key}", layer)
                assert torch.equal(on_disk, tensors[field]), (param, field)
    if sharding == "dp_reshardable":  # one bucket at TP 1: params in reverse order, each start 64-aligned
        prefix = "optimizer.distributed.dp_group_idx_0.gbuf_idx_0.dtype_(torch.float32, torch.float32).bucket_idx_0."
        flat = {k for k in metadata.state_dict_metadata if k.startswith("optimizer.distributed.")}
        assert {prefix + kind for kind in kinds.values()} <= flat
        buckets = _dcp_tensors(run.iteration_dir(), [prefix + kind for kind in kinds.values()])
        start = 0
        for param in reversed(list(saved["state"])):
            start = -(-start // 64) * 64
            count = saved["state"][param]["fp32"].numel()
            for field, kind in kinds.items():
                got = buckets[prefix + kind][start : start + count]
                assert torch.equal(got, saved["state"][param][field].flatten()), (param, field)
            start += count
        assert start == buckets[prefix + "param"].numel() == 90432
    assert final["iteration"] == TOTAL and set(final["steps"].values()) == {float(TOTAL)}


def test_losses_do_not_depend_on_the_layout() -> None:
    """use_cpu_initialization draws the same full weights at every TP and DP: one loss curve for all three."""
    curves = {name: saved_run(name).final()["losses"] for name in SAVES}
    want = curves["tp1dp2-dpr"]
    for name, got in curves.items():
        assert got.keys() == want.keys()
        assert max(abs(got[s] - want[s]) for s in want) <= LOSS_TOL, name


def _assert_state_equal(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["state"].keys() == want["state"].keys() and want["state"]
    for name, tensors in want["state"].items():
        assert got["state"][name].keys() == set(_MOMENTS)
        for field in _MOMENTS:
            assert torch.equal(got["state"][name][field], tensors[field]), f"{name} {field} differs"
    assert got["steps"] == want["steps"] and got["layer"] == want["layer"]
    for mine, theirs in zip(got["param_groups"], want["param_groups"], strict=True):
        assert mine == theirs
    assert got["scheduler"] == want["scheduler"]


#: (save run, resume layout (tp, pp, dp)): the save layout, a DP change (dp_reshardable), TP and PP changes
RESUMES = [
    ("tp1dp2-dpr", (1, 1, 2)),
    ("tp1dp2-dpr", (1, 1, 1)),
    ("tp1dp2-fr", (1, 1, 2)),
    ("tp1dp2-fr", (2, 1, 1)),
    ("tp1dp2-fr", (1, 2, 1)),
    ("tp2dp1-fr", (2, 1, 1)),
    ("tp2dp1-fr", (1, 1, 2)),
]


@pytest.mark.parametrize(("name", "layout"), RESUMES, ids=[f"{n}-to-tp{t}pp{p}dp{d}" for n, (t, p, d) in RESUMES])
def test_megatron_resume_continues_the_run(name: str, layout: tuple[int, int, int], tmp_path: Path) -> None:
    saver = saved_run(name)
    run = resume_at(saver.out, *layout, work=tmp_path, name="resume", steps=TOTAL - SAVED_AT)
    loaded, final, want = run.loaded(), run.final(), saver.final()
    assert loaded["iteration"] == SAVED_AT and loaded["sharding"] == SAVES[name][3]
    assert loaded["checkpoint_layout"] == dict(zip(("tp", "pp", "dp"), SAVES[name][:3]))
    assert loaded["rng_loaded"] == (layout[:2] == SAVES[name][:2])  # Megatron-LM: only at the same (TP, PP)
    assert loaded["consumed_train_samples"] == SAVED_AT * 4
    _assert_state_equal(loaded, saver.saved())
    assert sorted(final["losses"]) == list(range(SAVED_AT, TOTAL))
    for step, loss in final["losses"].items():
        assert abs(loss - want["losses"][step]) <= LOSS_TOL, (step, loss, want["losses"][step])
    assert set(final["steps"].values()) == {float(TOTAL)}
    diffs = [final["losses"][s] - want["losses"][s] for s in final["losses"]]
    print(f"resume {name} -> {layout}: {run.wall:.1f}s; loss diffs {diffs}")


def test_megatron_lm_refuses_a_tp_change_of_a_dp_reshardable_state(tmp_path: Path) -> None:
    with pytest.raises(RankFailure, match=r"\(TP, PP\) mismatch after resume \(\(2, 1\) vs \(1, 1\) from checkpoint\)"):
        resume_at(saved_run("tp1dp2-dpr").out, 2, 1, 1, work=tmp_path, name="refused")
    log = (tmp_path / "refused" / "logs" / "rank0.log").read_text()
    assert "not supported for DistributedOptimizer with sharding type dp_reshardable" in log


def test_load_fixes_are_needed_by_0_16_1(tmp_path: Path) -> None:
    """Without megatron_cpu.fix_load_path, megatron-core 0.16.1 cannot resume its own save with torch's Adam
    (a fresh optimizer's state dict asserts one step per param). A release that fixed this fails here: then
    the fixes may go."""
    version = importlib.metadata.version("megatron-core")
    if version != "0.16.1":
        pytest.skip(f"the fixes are for megatron-core 0.16.1, not {version}")
    with pytest.raises(RankFailure, match=r"assert len\(steps\) == 1"):
        resume_at(saved_run("tp1dp2-dpr").out, 1, 1, 2, work=tmp_path, name="unfixed", load_fixes=False)


def _batch(model: dict[str, Any], rows: int = 4, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model["vocab_size"], (rows, model["seq_length"] + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def test_hf_llama_gives_megatrons_loss(tmp_path: Path) -> None:
    """The trained checkpoint's weights mapped to a Hugging Face LlamaForCausalLM: the same loss within 1e-5
    and the same gradients (mapped back) on the same tokens, fp32. A wrong QKV split, gate/up order or norm
    epsilon misses the loss by far more (they are checked here too, so the bound is shown to bite)."""
    from tests.support.megatron_model import DEFAULT

    tokens, labels = _batch(DEFAULT)
    probe = forward_backward(tokens, labels, work=tmp_path, resume=str(saved_run("tp1dp2-fr").out))
    weights = {name: tensors["fp32"] for name, tensors in probe["state"].items()}
    hf = hf_from_megatron(weights, DEFAULT)
    loss, grads = hf_loss(DEFAULT, hf, tokens, labels)
    assert abs(loss - probe["loss"]) <= 1e-5, (loss, probe["loss"])
    back = megatron_from_hf(grads, DEFAULT)
    for name, grad in probe["grads"].items():
        assert torch.allclose(back[name], grad, rtol=1e-4, atol=1e-5 * grad.abs().max()), name
    assert all(torch.equal(megatron_from_hf(hf, DEFAULT)[n], w) for n, w in weights.items())  # a bijection
    wrong = dict(hf)
    for i in range(DEFAULT["num_layers"]):
        qkv = weights[f"decoder.layers.{i}.self_attention.linear_qkv.weight"]  # as if it were [q_all; k_all; v_all]
        q, k, v = qkv.split([64, 32, 32])
        wrong |= {f"model.layers.{i}.self_attn.{p}_proj.weight": t for p, t in zip("qkv", (q, k, v))}
    assert abs(hf_loss(DEFAULT, wrong, tokens, labels)[0] - probe["loss"]) > 1e-3
    swapped = dict(hf)
    for i in range(DEFAULT["num_layers"]):
        gate, up = f"model.layers.{i}.mlp.gate_proj.weight", f"model.layers.{i}.mlp.up_proj.weight"
        swapped[gate], swapped[up] = hf[up], hf[gate]
    assert abs(hf_loss(DEFAULT, swapped, tokens, labels)[0] - probe["loss"]) > 1e-3
    assert abs(hf_loss(dict(DEFAULT, layernorm_epsilon=1e-6), hf, tokens, labels)[0] - probe["loss"]) > 2e-5


def test_weights_probe_at_tp2_matches_the_hf_loss(tmp_path: Path) -> None:
    """Weights given by Megatron name (here an HF Llama's, mapped back) load into TP shards: Megatron at TP 2
    gives the HF loss."""
    from transformers import LlamaForCausalLM

    from tests.support.megatron_hf import hf_config
    from tests.support.megatron_model import DEFAULT

    torch.manual_seed(3)
    llama = LlamaForCausalLM._from_config(hf_config(DEFAULT), dtype=torch.float32)
    hf = {n: p.detach().clone() for n, p in llama.named_parameters()}
    with torch.no_grad():  # norms away from 1 so a wrong eps or a mixed-up norm shows
        hf |= {n: 1 + 0.1 * torch.randn_like(t) for n, t in hf.items() if n.endswith("norm.weight")}
    torch.save(megatron_from_hf(hf, DEFAULT), tmp_path / "weights.pt")
    tokens, labels = _batch(DEFAULT, seed=9)
    probe = forward_backward(tokens, labels, work=tmp_path, weights=str(tmp_path / "weights.pt"), tp=2)
    assert abs(probe["loss"] - hf_loss(DEFAULT, hf, tokens, labels)[0]) <= 1e-5
    assert all(torch.equal(probe["state"][n]["fp32"], w) for n, w in megatron_from_hf(hf, DEFAULT).items())
