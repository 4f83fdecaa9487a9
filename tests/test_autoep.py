"""DeepSpeed AutoEP (0.19.8 ``expert_parallel``): a tiny Hugging Face Mixtral (2 layers, 4 experts) trained on gloo
ranks at ep_size 2, ZeRO-1 on 2 ranks and ZeRO-2 on 4 (each expert-parallel rank's experts partitioned over 2
expert-data-parallel ranks), fp32 AdamW; converted to a universal directory in which every expert is an ordinary
parameter named by its global index, bit for bit against every rank's live engine; written back as a native AutoEP
checkpoint and resumed by DeepSpeed, bit-identically to its own resume at the same sizes and within 3e-7 at others.
ZeRO-3 runs (2 ranks and 4, ep_size 2: experts partitioned over 1 and 2 expert-data-parallel ranks) read with the
same expert names, bit for bit; written back at ZeRO-3 field for field as DeepSpeed wrote them and resumed
bit-identically to its own resume (within 1e-5 at other sizes, and from a ZeRO-1/2 source), and at ZeRO-2 like it.

The fixtures are real runs of ucp.harness.autoep; each rank records what its engine holds, its experts' slices of
the fused ``experts.w1/w2/w3`` under their global names.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

import ucp
from tests.support.autoep_runs import BuiltAutoEp, build_autoep, run_autoep_from
from tests.support.ds_convert import ds_to_universal
from tests.test_moe import assert_resumed_alike
from tests.test_reliability import assert_one_line_error, run_cli
from ucp.deepspeed.autoep import WEIGHTS, Partition, autoep_layers, expert_name, partition_of, rank_view
from ucp.deepspeed.layout import find_checkpoint
from ucp.deepspeed.optim_states import optimizer_block
from ucp.errors import ConfigError, InputError
from ucp.harness import LoadSpec
from ucp.io.torchfile import TorchFile
from ucp.model.partition import zero3_layout, zero3_partition_size
from ucp.sources import open_reader
from ucp.sources.autoep import AutoEpSource
from ucp.sources.zero3 import Zero3Source
from ucp.targets.autoep import write_autoep

pytestmark = pytest.mark.slow

RUNS = {"zero1-w2": dict(world=2, ep=2, stage=1), "zero2-w4": dict(world=4, ep=2, stage=2, global_batch=8)}
ZERO3 = {"zero3-w2": dict(world=2, ep=2, stage=3), "zero3-w4": dict(world=4, ep=2, stage=3, global_batch=8)}
PREFIXES = [f"lm.model.layers.{i}.mlp.experts" for i in range(2)]


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request: pytest.FixtureRequest) -> BuiltAutoEp:
    return build_autoep(**RUNS[request.param])


@pytest.fixture(scope="module")
def universal(run: BuiltAutoEp, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("autoep") / "u"
    ucp.to_universal(run.path, out)
    return out


def test_deepspeed_writes_one_file_per_expert_and_records_the_autoep_layers(run):
    names = sorted(p.name for p in run.tag_dir.iterdir())
    experts = [f"layer_{i}_expert_{e}_mp_rank_00_model_states.pt" for i in range(2) for e in range(4)]
    assert [n for n in names if "expert" in n] == experts
    assert [n for n in names if "optim" in n] == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(run.spec.world)
    ]
    with TorchFile(run.tag_dir / "mp_rank_00_model_states.pt") as tf:
        layers = autoep_layers(tf.obj, "model states")
        local = [list(g) for g in tf.obj["param_shapes"]][2]
    assert layers is not None
    assert [(x.module, x.prefix, x.experts, x.ep_size, x.placement) for x in layers] == [
        (p.removesuffix(".experts"), p, 4, 2, ((0, 1), (2, 3))) for p in PREFIXES
    ]
    assert layers[0].shapes == {"w1": (4, 23, 16), "w2": (4, 16, 23), "w3": (4, 23, 16)}
    assert local == [f"{p}.{w}" for p in PREFIXES for w in ("w1", "w2", "w3")]  # rank 0's local fused tensors
    with TorchFile(run.tag_dir / experts[5]) as tf:  # layer 1, expert 1
        assert sorted(tf.obj) == [expert_name(PREFIXES[1], w, 1) for w in ("w1", "w2", "w3")]


def assert_reader_matches_ranks(reader, run: BuiltAutoEp) -> None:
    """Every parameter (dense ones and each expert), state tensor and step is what the ranks' engines held."""
    expected = run.record
    assert expected["steps"] == {float(run.spec.steps)}
    facts = reader.facts
    assert [p.name for p in facts.params if not p.frozen] == [n for g in facts.groups for n in g.params]
    assert {p.name for p in facts.params} == set(expected["params"])
    assert sum(expert_name(p, "w2", 3) in expected["params"] for p in PREFIXES) == 2
    assert facts.step == run.spec.steps and facts.info.dp_world_size == run.spec.world
    keys = sorted(expected["state"])
    assert keys == ["exp_avg", "exp_avg_sq"]
    for meta in facts.params:
        state = reader.read(meta.name)
        assert state.fp32.shape == expected["params"][meta.name].shape, meta.name
        assert torch.equal(state.fp32, expected["params"][meta.name]), meta.name
        assert sorted(state.optim) == keys, meta.name
        for key, value in state.optim.items():
            assert torch.equal(value, expected["state"][key][meta.name]), (meta.name, key)
        assert state.step == run.spec.steps, meta.name


def test_to_universal_is_bit_exact_against_every_ranks_live_engine(run, universal):
    for path in (run.path, universal):
        with open_reader(path) as reader:
            assert_reader_matches_ranks(reader, run)


def test_every_expert_is_an_ordinary_parameter_with_its_own_files(run, universal):
    for prefix in PREFIXES:
        for e in range(4):
            folder = universal / "zero" / expert_name(prefix, "w1", e)
            assert sorted(p.name for p in folder.iterdir()) == ["exp_avg.pt", "exp_avg_sq.pt", "fp32.pt", "step.pt"]
            fp32 = torch.load(folder / "fp32.pt", weights_only=True)["param"]
            assert fp32.shape == (23, 16) and torch.equal(fp32, run.record["params"][expert_name(prefix, "w1", e)])


def test_the_expert_group_lists_every_expert_by_global_index_with_its_settings(run, universal):
    assert_expert_group_by_global_index(run, universal)


def assert_expert_group_by_global_index(run: BuiltAutoEp, universal: Path) -> None:
    """The expert group lists every expert of every layer by its global index, with the live group's settings."""
    live = run.record
    with open_reader(universal) as reader:
        groups = reader.facts.groups
        assert [g.raw["name"] for g in groups] == ["decay", "no_decay", "ep_size_2"]
        assert [g.raw.get("moe", False) for g in groups] == [False, False, True]
        assert groups[2].params == [
            expert_name(p, w, e) for p in PREFIXES for w in ("w1", "w2", "w3") for e in range(4)
        ]
        for rank_groups in live["group_params"]:  # each rank held its own experts in group 2
            assert set(rank_groups[2]) < set(groups[2].params) and len(rank_groups[2]) == 12
        assert groups[0].params == live["group_params"][0][0]
        assert [(g.hyper.lr, g.hyper.weight_decay) for g in groups] == [
            (h["lr"], h["weight_decay"]) for h in live["group_hparams"]
        ]
        layers = reader.facts.layout.record
        assert layers["ep_size"] == 2 and layers["world"] == run.spec.world
        assert [(x["prefix"], x["experts"], x["shapes"]["w2"]) for x in layers["layers"]] == [
            (p, 4, [4, 16, 23]) for p in PREFIXES
        ]


def test_a_missing_expert_file_is_refused_in_one_line(run, tmp_path, capsys):
    broken = tmp_path / "ckpt"
    shutil.copytree(run.tag_dir, broken)
    (broken / "layer_1_expert_2_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(InputError, match="AutoEP layer 1 .* lacks expert file 2"):
        AutoEpSource(find_checkpoint(broken, None))
    code, err = run_cli(capsys, "to-universal", str(broken), str(tmp_path / "u"))
    assert_one_line_error(code, err, "lacks expert file 2")
    assert not (tmp_path / "u").exists()


def test_an_expert_file_of_another_layer_is_refused_in_one_line(run, tmp_path, capsys):
    broken = tmp_path / "ckpt"
    shutil.copytree(run.tag_dir, broken)
    shutil.copy(
        broken / "layer_0_expert_1_mp_rank_00_model_states.pt", broken / "layer_1_expert_1_mp_rank_00_model_states.pt"
    )
    code, err = run_cli(capsys, "to-universal", str(broken), str(tmp_path / "u"))
    assert_one_line_error(code, err, "layer_1_expert_1_mp_rank_00_model_states.pt should hold")


# -- ZeRO-3 ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(ZERO3))
def z3(request: pytest.FixtureRequest) -> BuiltAutoEp:
    return build_autoep(**ZERO3[request.param])


@pytest.fixture(scope="module")
def z3_universal(z3: BuiltAutoEp, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("autoep-z3") / "u"
    ucp.to_universal(z3.path, out)
    return out


def test_deepspeed_zero3_partitions_dense_params_over_every_rank_and_experts_over_their_expert_data_parallel_ranks(z3):
    world, ep = z3.spec.world, z3.spec.ep
    edp = world // ep
    assert sorted(p.name for p in z3.tag_dir.iterdir()) == sorted(
        f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(world) for kind in ("model", "optim")
    )  # no expert files
    for rank in range(world):
        with TorchFile(z3.tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt") as tf:
            layers = autoep_layers(tf.obj, "model states", zero3=True)
            view = rank_view(tf.obj, "model states")
            shapes = [dict(g) for g in tf.obj["param_shapes"]]
        assert layers is not None and [x.placement for x in layers] == [((0, 1), (2, 3))] * 2
        assert view == (rank % ep, rank // ep)  # (ep rank, expert-data-parallel rank): its own view
        assert list(shapes[2]) == [f"{p}.{w}" for p in PREFIXES for w in WEIGHTS]  # the local fused tensors
        assert tuple(shapes[2][f"{PREFIXES[0]}.w2"]) == (2, 16, 23)
        with TorchFile(z3.tag_dir / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt") as tf:
            block = optimizer_block(tf)
            parts = [partition_of(block, sub, "optim states") for sub in range(3)]
            sizes = [t.numel() for t in block["fp32_flat_groups"]]
        assert parts[0] == parts[1] == Partition(world, rank, tuple(range(world)))
        assert parts[2] == Partition(edp, rank // ep, tuple(range(rank % ep, world, ep)))
        for sub, count in ((0, world), (1, world), (2, edp)):  # each parameter partitioned on its own
            assert sizes[sub] == sum(zero3_partition_size(math.prod(s), count) for s in shapes[sub].values())


def test_zero3_to_universal_is_bit_exact_against_every_ranks_live_engine(z3, z3_universal):
    for path in (z3.path, z3_universal):
        with open_reader(path) as reader:
            assert_reader_matches_ranks(reader, z3)
            assert reader.facts.info.zero_stage == 3


def test_zero3_experts_get_the_same_global_names_and_group_as_at_zero12(z3, z3_universal):
    assert_expert_group_by_global_index(z3, z3_universal)
    with open_reader(z3_universal) as ours, open_reader(build_autoep(**RUNS["zero1-w2"]).path) as zero1:
        assert [g.params for g in ours.facts.groups] == [g.params for g in zero1.facts.groups]
        assert ours.facts.layout.record["layers"] == zero1.facts.layout.record["layers"]


def test_the_plain_zero3_reader_refuses_an_autoep_save_in_one_line(z3):
    with pytest.raises(
        InputError, match=r"sub-group 2 is partition 0 of \d \(ranks \[0(, 2)?\]\), but it is read as 0"
    ):
        Zero3Source(find_checkpoint(z3.path, None))


def test_zero3_rank_files_of_another_expert_rank_are_refused_in_one_line(tmp_path, capsys):
    """Model states 1 and 2 swapped: rank file 1 then claims to hold expert-parallel rank 0's second partition,
    which optim file 1 does not."""
    run = build_autoep(**ZERO3["zero3-w4"])
    broken = tmp_path / "ckpt"
    shutil.copytree(run.tag_dir, broken)
    one, two = (broken / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in (1, 2))
    one.rename(tmp_path / "one")
    two.rename(one)
    (tmp_path / "one").rename(two)
    code, err = run_cli(capsys, "to-universal", str(broken), str(tmp_path / "u"))
    assert_one_line_error(code, err, "sub-group 2 is partition 0 of 2 (ranks [1, 3]), but it is read as 1 of 2 files")
    assert not (tmp_path / "u").exists()


@pytest.mark.parametrize("name", ["zero3-w2", "zero3-w4"])
def test_a_zero3_run_restored_at_zero2_resumes_like_deepspeeds_own_zero3_resume(name, tmp_path):
    """DeepSpeed's ZeRO-2 and ZeRO-3 trained from one state agree to ~1e-7, so the ZeRO-2 resume is held to
    DeepSpeed's ZeRO-3 one. Measured at 4 ranks: losses equal, fp32 within 1.2e-7,
    moments within 2.3e-9. At 2 ranks this found ucp writing clip_grad 0.0 for a ZeRO-3 source (which records
    none) where DeepSpeed 0.19.8 clips at 1.0: the resume stopped clipping (losses 2.7e-3 apart)."""
    run = build_autoep(**ZERO3[name])
    native = run_autoep_from(run, name="native", work=tmp_path, load=LoadSpec(str(run.path)))
    ucp.to_universal(run.path, tmp_path / "u")
    write_autoep(tmp_path / "u", tmp_path / "n", dp=run.spec.world, ep=run.spec.ep, stage=2)
    ours = run_autoep_from(run, name="ours", work=tmp_path, load=LoadSpec(str(tmp_path / "n")), stage=2)
    assert_resumed_alike(ours, native, atol=1e-6)


def _fields(path: Path) -> dict:
    """A rank file's fields, DeepSpeed's own ``sparse_tensor_module_names`` aside (ucp writes an empty set; 0.19.8
    saves it only when the module has sparse gradients)."""
    with TorchFile(path) as tf:
        return {k: v for k, v in tf.obj.items() if k != "sparse_tensor_module_names"}


def assert_same_fields(ours: object, theirs: object, where: str) -> None:
    """Equal values, tensors bit for bit (shape, dtype, bytes), dicts by key."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and sorted(map(str, ours)) == sorted(map(str, theirs)), where
        for key in theirs:
            assert_same_fields(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, list | tuple):
        assert isinstance(ours, list | tuple) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same_fields(a, b, f"{where}[{i}]")
    elif torch.is_tensor(theirs):
        assert torch.is_tensor(ours) and ours.dtype == theirs.dtype and torch.equal(ours, theirs), where
    else:
        assert ours == theirs or str(ours) == str(theirs), (where, ours, theirs)  # the loss scaler compares by text


@pytest.mark.parametrize(
    "counts, sub_group_size, sub_group_numel",
    [
        (None, None, (5, 6 * 184)),  # every group over all 4 ranks
        ([4, 2], None, (5, 6 * 368)),  # the expert group over its 2 expert-data-parallel ranks (the w4 fixture)
        ([4, 2], 1000, (5, 3 * 368, 3 * 368)),  # sub-groups cut by the partition size each rank holds
        ([4, 4], 1000, (5, 6 * 184)),
    ],
)
def test_the_zero3_layout_partitions_an_expert_group_over_fewer_ranks(counts, sub_group_size, sub_group_numel):
    layout = zero3_layout([[10, 7], [736] * 6], 4, sub_group_size, counts)
    assert layout.sub_group_numel == sub_group_numel
    assert layout.partition_count(1) == (counts or [4, 4])[1]
    with pytest.raises(ValueError, match="each dividing dp=4"):
        zero3_layout([[10], [736]], 4, None, [4, 3])


@pytest.fixture(scope="module")
def z3_native(z3: BuiltAutoEp, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """DeepSpeed's own resume of a ZeRO-3 fixture at its own sizes."""
    return run_autoep_from(z3, name="native", work=tmp_path_factory.mktemp("z3-native"), load=LoadSpec(str(z3.path)))


def test_a_zero3_run_restored_at_zero3_at_the_same_sizes_is_what_deepspeed_wrote_and_resumes_bit_identically(
    z3, z3_universal, z3_native, tmp_path
):
    """Every rank's model and optim file holds DeepSpeed's fields (its own ds_autoep_layers view, the expert
    sub-group partitioned over its expert-data-parallel ranks, ds_zero_partition_groups), and DeepSpeed resumes it
    exactly as it resumes its own save."""
    spec = z3.spec
    write_autoep(z3_universal, tmp_path / "n", dp=spec.world, ep=spec.ep, stage=3)
    tag = z3.tag_dir.name
    assert sorted(p.name for p in (tmp_path / "n" / tag).iterdir()) == sorted(p.name for p in z3.tag_dir.iterdir())
    for path in sorted(z3.tag_dir.iterdir()):
        assert_same_fields(_fields(tmp_path / "n" / tag / path.name), _fields(path), path.name)
    with open_reader(tmp_path / "n") as back:
        assert isinstance(back, AutoEpSource)
        assert_reader_matches_ranks(back, z3)
    ours = run_autoep_from(z3, name="same", work=tmp_path, load=LoadSpec(str(tmp_path / "n")))
    assert_resumed_alike(ours, z3_native, atol=0.0)


@pytest.fixture(scope="module")
def wide_z3() -> BuiltAutoEp:
    return build_autoep(**ZERO3["zero3-w4"])


@pytest.fixture(scope="module")
def wide_z3_native(wide_z3: BuiltAutoEp, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_autoep_from(
        wide_z3, name="native", work=tmp_path_factory.mktemp("wide-z3"), load=LoadSpec(str(wide_z3.path))
    )


@pytest.mark.parametrize("world, ep", [(2, 2), (2, 1), (4, 4)])
def test_a_zero3_run_restored_at_zero3_at_another_world_and_ep_size_resumes_like_deepspeeds_native_resume(
    wide_z3, wide_z3_native, world, ep, tmp_path
):
    """From 4 ranks at ep 2: ep 2 on 2 ranks (one expert-data-parallel rank), ep 1 (every rank holds every expert,
    partitioned over all), ep 4 (one expert each, unpartitioned). Measured: losses within 2.4e-7, fp32 within
    1.2e-7, moments within 2.3e-9 of DeepSpeed's resume at 4 x ep 2."""
    ucp.to_universal(wide_z3.path, tmp_path / "u")
    write_autoep(tmp_path / "u", tmp_path / "n", dp=world, ep=ep, stage=3)
    with open_reader(tmp_path / "n") as back:
        assert back.facts.info.zero_stage == 3 and back.facts.layout.record["ep_size"] == ep
    ours = run_autoep_from(wide_z3, name="ours", work=tmp_path, load=LoadSpec(str(tmp_path / "n")), world=world, ep=ep)
    assert_resumed_alike(ours, wide_z3_native, atol=3e-7)


@pytest.mark.parametrize("world, ep", [(4, 2), (2, 2)])
def test_a_zero12_run_restored_at_zero3_resumes_like_deepspeeds_native_resume(
    wide, wide_native, universal_of_wide, world, ep, tmp_path
):
    """The ZeRO-2 run (4 ranks, ep 2) resumed at ZeRO-3 is held to DeepSpeed's own ZeRO-2 resume. Measured: at 4 x ep 2
    losses equal, fp32 within 3.5e-8; at 2 x ep 2 losses within 2.4e-7, fp32 1.2e-7; moments within 5e-9."""
    write_autoep(universal_of_wide, tmp_path / "n", dp=world, ep=ep, stage=3)
    ours = run_autoep_from(
        wide, name="ours", work=tmp_path, load=LoadSpec(str(tmp_path / "n")), world=world, ep=ep, stage=3
    )
    assert_resumed_alike(ours, wide_native, atol=3e-7)


def test_a_cli_restore_of_a_zero3_autoep_source_writes_zero3_unless_told(z3, z3_universal, tmp_path, capsys):
    """The source's stage by default, as for ZeRO-1/2 sources; ``--stage 2`` still writes ZeRO-2."""
    for stage, flags in ((3, ()), (3, ("--stage", "3")), (2, ("--stage", "2"))):
        out = tmp_path / f"n{stage}{len(flags)}"
        code, err = run_cli(capsys, "restore", str(z3_universal), str(out), "--dp", str(z3.spec.world), *flags)
        assert code == 0, err
        with open_reader(out) as back:
            assert isinstance(back, AutoEpSource) and back.facts.info.zero_stage == stage


def test_a_cli_restore_of_the_universal_directory_writes_an_autoep_checkpoint(run, universal, tmp_path, capsys):
    """The experts are per-expert parameters there; the CLI routes them to write_autoep (at the source's autoep_size
    by default), never to a dense-shaped or legacy-MoE write (tests/test_autoep_surface.py has the rest)."""
    code = run_cli(capsys, "restore", str(universal), str(tmp_path / "n"), "--dp", str(run.spec.world))[0]
    assert code == 0
    with open_reader(tmp_path / "n") as back:
        assert isinstance(back, AutoEpSource) and back.facts.layout.record["ep_size"] == run.spec.ep


@pytest.fixture(scope="module")
def native(run: BuiltAutoEp, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """DeepSpeed's own resume of the fixture at its own sizes."""
    return run_autoep_from(run, name="native", work=tmp_path_factory.mktemp("native"), load=LoadSpec(str(run.path)))


def test_restore_at_the_same_sizes_reads_back_and_resumes_bit_identically_to_deepspeed(
    run, universal, native, tmp_path
):
    spec = run.spec
    write_autoep(universal, tmp_path / "n", dp=spec.world, ep=spec.ep, stage=spec.stage)
    with open_reader(tmp_path / "n") as back:
        assert isinstance(back, AutoEpSource)  # its ds_autoep_layers are DeepSpeed's shape
        assert_reader_matches_ranks(back, run)
    ours = run_autoep_from(run, name="same", work=tmp_path, load=LoadSpec(str(tmp_path / "n")))
    assert_resumed_alike(ours, native, atol=0.0)


@pytest.fixture(scope="module")
def wide() -> BuiltAutoEp:
    return build_autoep(**RUNS["zero2-w4"])


@pytest.fixture(scope="module")
def wide_native(wide: BuiltAutoEp, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_autoep_from(wide, name="native", work=tmp_path_factory.mktemp("wide"), load=LoadSpec(str(wide.path)))


@pytest.fixture(scope="module")
def universal_of_wide(wide: BuiltAutoEp, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wide-u") / "u"
    ucp.to_universal(wide.path, out)
    return out


@pytest.mark.parametrize("world, ep", [(2, 1), (2, 2), (4, 4)])
def test_restore_at_another_world_and_ep_size_resumes_like_deepspeeds_native_resume(
    wide, wide_native, world, ep, tmp_path
):
    """Measured: losses within 2.4e-7, fp32 within 1.2e-7, moments within 2.8e-9 of DeepSpeed's resume at 4 x ep 2."""
    ucp.to_universal(wide.path, tmp_path / "u")
    write_autoep(tmp_path / "u", tmp_path / "n", dp=world, ep=ep, stage=2)
    ours = run_autoep_from(wide, name="ours", work=tmp_path, load=LoadSpec(str(tmp_path / "n")), world=world, ep=ep)
    assert_resumed_alike(ours, wide_native, atol=3e-7)


def test_sizes_deepspeed_refuses_are_refused_before_anything_is_written(universal, tmp_path):
    with pytest.raises(ConfigError, match="must divide the number of ranks"):
        write_autoep(universal, tmp_path / "n", dp=4, ep=3, stage=2)
    with pytest.raises(ConfigError, match="ZeRO-1, 2 or 3 at TP=1"):
        write_autoep(universal, tmp_path / "n", dp=2, ep=2, stage=3, tp=2)
    assert not (tmp_path / "n").exists()


def test_deepspeeds_ds_to_universal_keeps_each_fused_tensor_whole_with_the_same_values(run, universal, tmp_path):
    """DeepSpeed's converter handles AutoEP (its save carries universal_checkpoint_info): one folder per fused
    ``experts.w1`` of shape [experts, ...]; stacking ucp's per-expert parameters gives the same bytes."""
    done = ds_to_universal(run.tag_dir, tmp_path / "ds")
    assert done.returncode == 0, done.stderr[-2000:]
    with open_reader(universal) as ours:
        for prefix in PREFIXES:
            folder = tmp_path / "ds" / "zero" / f"{prefix}.w2"
            assert not (tmp_path / "ds" / "zero" / expert_name(prefix, "w2", 0)).exists()
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                theirs = torch.load(folder / f"{key}.pt", weights_only=True)
                theirs = theirs["param"] if isinstance(theirs, dict) else theirs
                states = [ours.read(expert_name(prefix, "w2", e)) for e in range(4)]
                stacked = torch.stack([s.fp32 if key == "fp32" else s.optim[key] for s in states])
                assert theirs.shape == (4, 16, 23) and torch.equal(theirs, stacked), (prefix, key)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_bf16_run_reads_bit_exact_and_resumes_at_the_same_sizes_bit_identically(stage, tmp_path):
    """bf16 AutoEP (ZeRO-1: BF16 masters in DeepSpeedZeroOptimizer; ZeRO-3): the ranks' fp32 masters and moments
    read bit for bit, and written back at the source's sizes the run resumes as DeepSpeed's own resume does."""
    run = build_autoep(world=2, ep=2, stage=stage, dtype="bf16")
    with open_reader(run.path) as reader:
        assert reader.facts.info.dtype == "bf16"
        assert_reader_matches_ranks(reader, run)
    ucp.to_universal(run.path, tmp_path / "u")
    write_autoep(tmp_path / "u", tmp_path / "n", dp=2, ep=2, stage=stage)
    native = run_autoep_from(run, name="native", work=tmp_path, load=LoadSpec(str(run.path)))
    ours = run_autoep_from(run, name="ours", work=tmp_path, load=LoadSpec(str(tmp_path / "n")))
    assert_resumed_alike(ours, native, atol=0.0)
