"""Tensor parallelism: DeepSpeed AutoTP checkpoints merged into full parameters and cut again.

The fixtures are real AutoTP runs (TP=2) of the harness model: a column-parallel first projection
(in the SwiGLU variant, a fused gate+up weight of two sub-parameters), a row-parallel second one,
and replicated embedding, norms, biases and a frozen projection. Sizes are odd (ffn=23), so the
ranks hold 12 and 11 rows. The expected full tensors below are spelled out from that layout by
hand, independently of ucp.tp.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TP_SOURCES
from hypothesis import given, settings
from hypothesis import strategies as st

import ucp
from tests.support.files import resave
from tests.support.fixtures import Built, resume
from tests.support.tp_records import assert_training_close, expected_full, full_record, records
from ucp.errors import InputError
from ucp.harness import LoadSpec
from ucp.harness.worker import record_path
from ucp.io import torchfile
from ucp.model import tp as tpl
from ucp.sources import open_reader


@pytest.fixture(scope="module")
def tp_native_resume(tmp_path_factory):
    cache: dict[str, list[dict[str, Any]]] = {}
    work = tmp_path_factory.mktemp("tp-native")

    def get(built: Built) -> list[dict[str, Any]]:
        key = str(built.path)
        if key not in cache:
            name = f"native{len(cache)}"
            resume(built, LoadSpec(str(built.path)), name=name, work=work)
            cache[key] = records(work / f"{name}.pt", built.spec.tp)
        return cache[key]

    return get


def with_info(built: Built, folder: Path, edit: Callable[[dict[str, Any]], dict[str, Any] | None]) -> Path:
    """A copy of ``built``'s checkpoint whose ``universal_checkpoint_info`` is ``edit(info)`` (None: removed)."""
    copy = folder / "ckpt"
    shutil.copytree(built.path, copy)
    for path in copy.glob("*/mp_rank_*_model_states.pt"):
        states = torchfile.load(path)
        info = edit(dict(states.pop("universal_checkpoint_info")))
        if info is not None:
            states["universal_checkpoint_info"] = info
        resave(states, path)
    return copy


def assert_same_state(ours_path: Path, theirs_path: Path, **ours_options: Any) -> None:
    """Both paths read as the same rules and the same tensors, bit for bit."""
    ours, theirs = open_reader(ours_path, **ours_options), open_reader(theirs_path)
    try:
        assert ours.facts.tp_rules == theirs.facts.tp_rules
        for meta in theirs.facts.params:
            a, b = ours.read(meta.name), theirs.read(meta.name)
            assert torch.equal(a.fp32, b.fp32), meta.name
            assert meta.frozen or (
                torch.equal(a.optim["exp_avg"], b.optim["exp_avg"])
                and torch.equal(a.optim["exp_avg_sq"], b.optim["exp_avg_sq"])
                and a.step == b.step
            ), meta.name
    finally:
        ours.close()
        theirs.close()


# -- the layout maths ------------------------------------------------------------------------
def test_shard_widths_follow_deepspeed_autotp():
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size_list

    for size in (1, 2, 7, 23, 46, 64):
        for tp in (1, 2, 3, 4):
            if size >= tp:
                assert tpl.shard_widths(size, tp) == get_shard_size_list(size, tp, AutoTPMeta(), name="x")


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 6),
    tp=st.integers(1, 4),
    dim=st.integers(0, 1),
    n_parts=st.integers(1, 3),
    seed=st.integers(0, 1000),
)
def test_scatter_then_gather_is_the_identity(rows, cols, tp, dim, n_parts, seed):
    shape = [rows * n_parts, cols] if dim == 0 else [rows, cols * n_parts]
    parts = tuple([shape[dim] // n_parts] * n_parts) if n_parts > 1 else ()
    rule = tpl.TpRule("split", dim=dim, parts=parts)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    layouts = tpl.layouts_for(rule, shape, tp)
    shards = [tpl.scatter(full, lay) for lay in layouts]
    assert sum(s.shape[dim] for s in shards) == shape[dim]
    assert torch.equal(tpl.gather(shards, layouts, shape), full)


def test_vocab_rows_are_padded_in_the_shards_and_dropped_in_the_full_tensor():
    rule = tpl.TpRule("split", dim=0, vocab=5, padded=8)
    full = torch.arange(10.0).reshape(5, 2)
    layouts = tpl.layouts_for(rule, (5, 2), 2)
    shards = [tpl.scatter(full, lay) for lay in layouts]
    assert [tuple(s.shape) for s in shards] == [(4, 2), (4, 2)]
    assert torch.equal(shards[1][1:], torch.zeros(3, 2))  # rows 5..7 are padding
    assert torch.equal(tpl.gather(shards, layouts, (5, 2)), full)


def test_average_and_replicated_merge():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    avg = tpl.layouts_for(tpl.TpRule("average"), (2,), 2)
    assert torch.equal(tpl.gather([a, b], avg, (2,)), torch.tensor([2.0, 3.0]))
    rep = tpl.layouts_for(tpl.REPLICATED, (2,), 2)
    assert torch.equal(tpl.gather([a, a], rep, (2,)), a)


def test_megatron_style_info_patterns():
    info = {
        "tp_replicated_parameter_patterns": [r".*layernorm.*"],
        "parameter_to_average_patterns": [r".*position_embeddings.*"],
        "parameter_with_row_parallelism_patterns": [r".*dense_4h_to_h\.weight$"],
        "vocabulary_parameter_patterns": [r".*word_embeddings\.weight$"],
        "parameter_with_2_sub_params_cat_dim_0": [r".*dense_h_to_4h\.weight$"],
        "original_vocab_size": 50,
    }
    shapes = {
        "ln.layernorm.weight": [(8,), (8,)],
        "pos.position_embeddings.weight": [(4, 8), (4, 8)],
        "mlp.dense_4h_to_h.weight": [(8, 16), (8, 16)],
        "mlp.dense_h_to_4h.weight": [(32, 8), (32, 8)],
        "emb.word_embeddings.weight": [(32, 8), (32, 8)],
        "attn.query_key_value.weight": [(24, 8), (24, 8)],
    }
    rules = tpl.rules_from_info(info, shapes)
    assert rules["ln.layernorm.weight"] == tpl.REPLICATED
    assert rules["pos.position_embeddings.weight"].kind == "average"
    assert rules["mlp.dense_4h_to_h.weight"] == tpl.TpRule("split", dim=1)
    assert rules["mlp.dense_h_to_4h.weight"] == tpl.TpRule("split", dim=0, parts=(32, 32))
    assert rules["emb.word_embeddings.weight"] == tpl.TpRule("split", dim=0, vocab=50, padded=64)
    assert rules["attn.query_key_value.weight"] == tpl.TpRule("split", dim=0)
    assert tpl.full_shape(rules["emb.word_embeddings.weight"], shapes["emb.word_embeddings.weight"]) == (50, 8)


# -- real AutoTP checkpoints -----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", list(TP_SOURCES))
def test_tp_checkpoint_merges_bit_exact_into_full_parameters(name, source, universals):
    built = source(name)
    recs = [torch.load(record_path(str(built.record_path), r), weights_only=True) for r in range(2)]
    reader = open_reader(universals(name))
    try:
        facts = reader.facts
        assert facts.info.mp_world_size == 2
        split = {n for n, r in facts.tp_rules.items() if r["kind"] == "split"}
        assert split == {n for n in recs[0]["params"] if re.search(r"\.(up|down|0|2)\.weight$|\.(up|0)\.bias$", n)}
        for meta in facts.params:
            state = reader.read(meta.name)
            if meta.frozen:
                assert torch.equal(state.fp32, expected_full(meta.name, [r["module"][meta.name] for r in recs]).float())
                continue
            assert list(state.optim) == ["exp_avg", "exp_avg_sq"], meta.name
            for key in ("params", "exp_avg", "exp_avg_sq"):
                want = expected_full(meta.name, [r[key][meta.name] for r in recs])
                got = state.fp32 if key == "params" else state.optim[key]
                assert torch.equal(got, want), (meta.name, key)
            assert state.step == built.spec.steps
        assert facts.tied == recs[0]["tied"]
    finally:
        reader.close()


@pytest.mark.slow
@pytest.mark.parametrize("name,atol", [("tp2-z2-fp32-dp1", 1e-5), ("tp2-z1-bf16-dp2-glu", 2e-3)])
def test_tp2_checkpoint_resumes_without_tp_like_the_native_tp2_resume(
    name, atol, source, universals, tp_native_resume, tmp_path
):
    built = source(name)
    ucp.write_native(universals(name), tmp_path / "n", dp=2, stage=built.spec.stage)
    ours = resume(built, LoadSpec(str(tmp_path / "n")), dp=2, tp=1, name="tp1", work=tmp_path)
    assert_training_close(full_record(tp_native_resume(built)), ours, atol=atol)


@pytest.mark.slow
def test_restore_into_live_tp2_engine_is_bit_identical_to_native_resume(source, universals, tp_native_resume, tmp_path):
    built = source("tp2-z2-fp32-dp1")
    resume(built, LoadSpec(str(universals("tp2-z2-fp32-dp1")), kind="ucp"), name="live", work=tmp_path)
    ours = records(tmp_path / "live.pt", 2)
    for ref, got in zip(tp_native_resume(built), ours):
        assert ref["losses"] == got["losses"]
        for key in ("params", "exp_avg", "exp_avg_sq"):
            for n, value in ref[key].items():
                assert torch.equal(value, got[key][n]), (key, n)
        assert set(got["state_steps"]) == set(ref["state_steps"])


@pytest.mark.slow
def test_checkpoint_without_tp_restores_into_a_live_tp2_engine(source, universals, native_resume, tmp_path):
    """TP=1 -> TP=2: the live AutoTP model's own layout cuts the full parameters."""
    built = source("z1-fp32-dp2-adamw")
    resume(built, LoadSpec(str(universals("z1-fp32-dp2-adamw")), kind="ucp"), dp=1, tp=2, name="live", work=tmp_path)
    ours = full_record(records(tmp_path / "live.pt", 2))
    assert_training_close(native_resume(built), ours, atol=1e-5)


@pytest.mark.slow
def test_tp_checkpoint_without_info_needs_rules(source, tmp_path):
    built = source("tp2-z2-fp32-dp1")
    copy = with_info(built, tmp_path, lambda info: None)
    with pytest.raises(InputError, match="no rule for .*tensor_parallel.rules"):
        open_reader(copy)
    rules = [
        (r"^blocks\.\d+\.0\.", tpl.TpRule("split", dim=0)),
        (r"^blocks\.\d+\.2\.weight$", tpl.TpRule("split", dim=1)),
        (r".*", tpl.REPLICATED),
    ]
    assert_same_state(copy, built.path, tp_rules=rules)


@pytest.mark.slow
@pytest.mark.parametrize("name,dp", [("tp2-z2-fp32-dp1", 1), ("tp2-z1-bf16-dp2-glu", 1)])
def test_native_tp2_checkpoint_from_universal_loads_in_deepspeed_autotp(
    name, dp, source, universals, tp_native_resume, tmp_path
):
    """Re-split: universal -> mp_rank_00/01 files at TP=2 that stock DeepSpeed AutoTP loads natively."""
    built = source(name)
    plan = ucp.write_native(universals(name), tmp_path / "n", dp=dp, stage=built.spec.stage, tp=2)
    tag_dir = tmp_path / "n" / plan.tag
    assert sorted(p.name for p in tag_dir.glob("mp_rank_*")) == [
        "mp_rank_00_model_states.pt",
        "mp_rank_01_model_states.pt",
    ]
    resume(built, LoadSpec(str(tmp_path / "n")), dp=dp, name="native-tp2", work=tmp_path)
    ours = records(tmp_path / "native-tp2.pt", 2)
    reference = tp_native_resume(built)
    if dp == built.spec.dp:  # same layout: the very same training
        for ref, got in zip(reference, ours):
            assert ref["losses"] == got["losses"]
            for key in ("params", "exp_avg", "exp_avg_sq"):
                for n, value in ref[key].items():
                    assert torch.equal(value, got[key][n]), (key, n)
    else:
        assert_training_close(full_record(reference), full_record(ours), atol=2e-3)
    # and the written checkpoint converts back to the same universal state
    assert_same_state(tmp_path / "n", universals(name))


@pytest.mark.slow
def test_yaml_rules_cut_a_checkpoint_without_tp_for_a_tp2_run(source, native_resume, tmp_path):
    """TP=1 -> TP=2 offline: the migration YAML gives the rules the source never had."""
    from ucp.migrate import run_migration

    built = source("z1-fp32-dp2-adamw")
    config = tmp_path / "m.yaml"
    config.write_text(f"""source: {built.path}
tensor_parallel:
  rules:
    - {{pattern: '^blocks\\.\\d+\\.0\\.', kind: split, dim: 0}}
    - {{pattern: '^blocks\\.\\d+\\.2\\.weight$', kind: split, dim: 1}}
    - {{pattern: '.*', kind: replicated}}
target: {{dp: 1, stage: 1, tp: 2, output: {tmp_path / "tp2"}}}
""")
    assert "tp=2" in run_migration(config, dry_run=True)
    run_migration(config)
    resume(built, LoadSpec(str(tmp_path / "tp2")), dp=1, tp=2, name="tp2", work=tmp_path)
    ours = full_record(records(tmp_path / "tp2.pt", 2))
    assert_training_close(native_resume(built), ours, atol=1e-5)


@pytest.mark.slow
def test_tp_target_without_rules_is_refused_in_one_line(source, universals, tmp_path):
    with pytest.raises(InputError, match=r"^no tensor-parallel rule for 'embed\.weight'.*tensor_parallel\.rules"):
        ucp.write_native(universals("z1-fp32-dp2-adamw"), tmp_path / "n", dp=1, stage=1, tp=2)
    assert not (tmp_path / "n").exists()
    with pytest.raises(ucp.errors.ConfigError, match="--tp > 1 needs --stage 0, 1 or 2"):
        ucp.write_native(universals("z1-fp32-dp2-adamw"), tmp_path / "n", dp=1, stage=3, tp=2)


@pytest.mark.slow
def test_a_stray_pipeline_layer_file_in_a_tp_checkpoint_is_refused_in_one_line(source, tmp_path):
    """A layer file makes the folder a pipeline checkpoint (read with its TP ranks since pipeline x TP is read);
    one for TP rank 0 only, where the model-states files say tp_degree=2, is a mix of runs."""
    copy = tmp_path / "ckpt"
    shutil.copytree(source("tp2-z2-fp32-dp1").path, copy)
    tag = next(p for p in copy.iterdir() if p.is_dir())
    (tag / "layer_01-model_00-model_states.pt").write_bytes(b"")
    with pytest.raises(InputError, match=r"layer files are for tensor-parallel ranks \[0\], but .* tp_degree=2"):
        open_reader(copy)


@pytest.mark.parametrize(
    "damage",
    [
        {"tp_replicated_parameter_patterns": ["("]},  # not a regex
        {"parameter_with_sub_params": 5},
        {"parameter_with_sub_params": [{"patterns": [r"^blocks\.0\.0\.weight$"], "shape": [7], "partition_dim": 3}]},
        {"affine_map": {"version": 1, "params": {r"^embed\.weight$": {"logical_shape": [37, 10]}}}},
        {"affine_map": {"version": 9, "params": {}}},
        {"vocabulary_parameter_patterns": [r"^blocks\.0\.0\.weight$"]},  # no original_vocab_size
    ],
)
@pytest.mark.slow
def test_damaged_universal_checkpoint_info_is_refused_in_one_line(source, tmp_path, damage):
    def edit(info: dict[str, Any]) -> dict[str, Any]:
        if "affine_map" not in damage:
            info.pop("affine_map")  # so that the pattern lists decide the layout
        return {**info, **damage}

    copy = with_info(source("tp2-z2-fp32-dp1"), tmp_path, edit)
    with pytest.raises(InputError) as caught:
        open_reader(copy)
    assert "universal_checkpoint_info" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TP_SOURCES))
def test_pattern_lists_alone_merge_like_the_affine_map(name, source, tmp_path):
    """Megatron-DeepSpeed writes only the pattern lists: without the affine map the merge is the same."""
    built = source(name)
    copy = with_info(built, tmp_path, lambda info: {k: v for k, v in info.items() if k != "affine_map"})
    assert_same_state(copy, built.path)
