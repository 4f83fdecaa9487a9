"""ZeRO-Infinity's NVMe-offloaded optimizer state (``offload_optimizer.device: nvme``, ZeRO-3), real runs on CPU.

Such a run keeps each sub-group of 1 MiB or more per rank in swap files; its optim files hold an empty flat tensor
and empty moments for it, and a save copies the swap files to ``<tag>/offloaded_tensors/rank<NN>/``. Smaller
sub-groups stay in the optim files. The runs here need DeepSpeed's async_io op, which needs libaio
(``apt-get install libaio-dev``); without it they skip.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import ucp
from tests.support.checks import assert_every_state_equals_record, assert_reader_holds_every_state
from tests.support.fixtures import build, resume
from ucp.cli import main as cli
from ucp.harness import LoadSpec
from ucp.harness.launch import RankFailure
from ucp.harness.spec import ModelSpec
from ucp.io.torchfile import load
from ucp.sources import opened
from ucp.universal import open_universal


def _async_io() -> bool:
    """Whether DeepSpeed's async_io op builds and loads here (built once, then cached with DeepSpeed's other ops)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return False
        builder.load(verbose=False)
        return True
    except Exception:  # noqa: BLE001  # no DeepSpeed, no libaio, a failed build: no NVMe runs
        return False


# every test trains a real NVMe-offload run (the real-run tier), and only where the op builds
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not _async_io(), reason="DeepSpeed's async_io op needs libaio (libaio-dev)"),
]

# 2.7M elements in group 0 cut in sub-groups of 300,000 per rank (three of them swapped), group 1 small (kept in
# the optim files): both kinds in one save
RUN = dict(
    dp=2,
    stage=3,
    dtype="bf16",
    optimizer="ds-cpu-adam",
    offload=True,
    nvme=True,
    sub_group_size=300_000,
    model=ModelSpec(vocab=1031, hidden=520, ffn=1037),
)


@pytest.fixture(scope="module")
def universal(tmp_path_factory):
    out = tmp_path_factory.mktemp("nvme") / "u"
    ucp.to_universal(build(**RUN).path, out)
    return out


def _swapped(tag_dir: Path) -> tuple[int, int]:
    """(sub-groups whose flat masters the optim file leaves empty, swap files) on rank 0: the save is what the test
    says it is."""
    block = load(sorted(tag_dir.glob("*optim_states.pt"))[0])["optimizer_state_dict"]
    empty = sum(1 for t in block["fp32_flat_groups"] if t.numel() == 0)
    return empty, len(list((tag_dir / "offloaded_tensors" / "rank00").glob("*.tensor.swp")))


def test_the_swap_files_and_the_optim_files_give_every_master_and_moment_bit_exact(universal):
    built = build(**RUN)
    assert _swapped(built.tag_dir) == (3, 9)  # 3 sub-groups: masters, exp_avg, exp_avg_sq each
    with opened(built.path) as source:
        assert any("3 of 4 sub-groups are read from the NVMe swap files" in w for w in source.facts.warnings)
    with open_universal(universal) as reader:
        assert_reader_holds_every_state(reader, built.record)


@pytest.mark.parametrize("dp", [1, 3])
def test_a_new_dp_loads_the_nvme_runs_state_natively_and_live(universal, dp, tmp_path, capsys):
    built = build(**RUN)
    capsys.readouterr()
    assert cli(["restore", str(universal), str(tmp_path / "n"), "--dp", str(dp)]) == 0
    assert "load them in a run that offloads the optimizer to CPU memory" in capsys.readouterr().err
    # a run offloading to CPU memory loads the plain ZeRO-3 files ucp writes
    native = resume(built, LoadSpec(str(tmp_path / "n")), dp=dp, steps=0, nvme=False, name="native", work=tmp_path)
    assert_every_state_equals_record(native, built.record)
    live = resume(built, LoadSpec(str(universal), kind="ucp"), dp=dp, steps=0, nvme=False, name="live", work=tmp_path)
    assert_every_state_equals_record(live, built.record)


def test_a_save_without_its_swap_files_is_refused_in_one_line(tmp_path, capsys):
    built = build(**RUN)
    folder = tmp_path / "ckpt"
    shutil.copytree(built.path, folder)
    shutil.rmtree(folder / built.tag_dir.name / "offloaded_tensors")
    capsys.readouterr()
    assert cli(["to-universal", str(folder), str(tmp_path / "u")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rank00" in err and "offloaded_tensors" in err and "missing" in err, err
    assert not (tmp_path / "u").exists()


def test_a_short_swap_file_is_refused_in_one_line(tmp_path, capsys):
    built = build(**RUN)
    folder = tmp_path / "ckpt"
    shutil.copytree(built.path, folder)
    swap = folder / built.tag_dir.name / "offloaded_tensors" / "rank01" / "exp_avg-3_5.tensor.swp"
    with open(swap, "r+b") as handle:
        handle.truncate(4096)
    capsys.readouterr()
    assert cli(["to-universal", str(folder), str(tmp_path / "u")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "exp_avg-3_5.tensor.swp has 4,096 bytes" in err, err
    assert not (tmp_path / "u").exists()


def test_a_live_restore_into_an_nvme_engine_is_refused_in_one_line(universal, tmp_path):
    built = build(**RUN)
    with pytest.raises(RankFailure, match="swaps its optimizer state to NVMe"):
        resume(built, LoadSpec(str(universal), kind="ucp"), steps=0, name="live", work=tmp_path)


def test_ucps_restore_takes_the_uninterrupted_runs_first_step_where_deepspeeds_own_nvme_resume_does_not(
    universal, tmp_path
):
    """Pinned: DeepSpeed 0.19.8 resuming its own NVMe save at the same DP puts back the new run's initial masters of
    the sub-group it keeps in memory (measured: norm.weight 1.0; first loss 93.04 where the run without a break had
    83.67). ucp's restore into a run
    offloading to CPU memory takes exactly the uninterrupted run's first step (later ones part: a CPU-offload run
    and an NVMe run of DeepSpeed 0.19.8 train apart even from scratch)."""
    built = build(**RUN)
    whole = build(**{**RUN, "steps": built.spec.steps + 1}).record["losses"][-1]
    ours = resume(built, LoadSpec(str(universal), kind="ucp"), steps=1, nvme=False, name="live", work=tmp_path)
    assert ours["losses"] == [whole]
    native = resume(built, LoadSpec(str(built.path)), steps=1, name="native", work=tmp_path)
    assert abs(native["losses"][0] - whole) > 1.0, (native["losses"], whole)


# parameters swapped too: the frozen projection (1040 x 1040, 1.08 MB per rank in bf16) is swapped
PARAMS = dict(RUN, offload_param=True, sub_group_size=0, model=ModelSpec(vocab=131, hidden=1040, ffn=97))


def test_a_frozen_weight_deepspeed_saved_as_a_placeholder_is_refused_saying_why(tmp_path, capsys):
    built = build(**PARAMS)
    capsys.readouterr()
    assert cli(["to-universal", str(built.path), str(tmp_path / "u")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'proj.weight' holds 1 elements" in err and "offload_param" in err, err
    assert not (tmp_path / "u").exists()


def test_with_the_frozen_weights_excluded_every_trained_state_is_read_bit_exact(tmp_path):
    built = build(**PARAMS, exclude_frozen=True)
    ucp.to_universal(built.path, tmp_path / "u")
    with open_universal(tmp_path / "u") as reader:
        assert reader.facts.info.frozen_excluded
        assert_reader_holds_every_state(reader, built.record)
