"""Weights fp16 cannot hold are refused, never written as inf.

A value of magnitude 65520 or more becomes inf in fp16. Written so, an fp16 run overflows on every step (each one
skipped, the loss scale sinking to its minimum) and an fp16 export is unusable, with nothing said. The source here
is a real torch run of the harness's model saved with torch.distributed.checkpoint, in which one LayerNorm weight
was scaled to 1e5 (bf16 and fp32 hold it): every way to fp16 (export, a native ZeRO-0/1/2/3 restore, the live
restore into a DeepSpeed fp16 engine or a plain fp16 model) refuses it in one line, writes nothing and changes
nothing; bf16 takes it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ucp
from tests.support.fixtures import Built, resume
from ucp.cli import main as cli
from ucp.errors import ConfigError
from ucp.harness import LoadSpec, ModelSpec, RunSpec
from ucp.harness.launch import RankFailure
from ucp.harness.model import TinyLM, build_param_groups
from ucp.model.cast import narrowed
from ucp.sources import open_reader

BIG = 1e5
FROZEN = ["--frozen", "proj.weight", "proj.bias"]


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A universal directory of a torch AdamW run whose ``norm.weight`` is about 1e5 after 3 steps."""
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(1234)
    model = TinyLM(ModelSpec())
    with torch.no_grad():
        model.norm.weight.mul_(BIG)
    optimizer = torch.optim.AdamW(build_param_groups(model, 2, 1e-2), lr=1e-2)
    tokens = torch.randint(0, 37, (4, 9), generator=torch.Generator().manual_seed(7))
    for _ in range(3):
        model(tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    root = tmp_path_factory.mktemp("fp16-range")
    model_state, optim_state = get_state_dict(model, optimizer)
    save({"model": model_state, "optim": optim_state}, checkpoint_id=root / "dcp", no_dist=True)
    assert cli(["to-universal", str(root / "dcp"), str(root / "u"), *FROZEN]) == 0
    with open_reader(root / "u") as reader:
        assert reader.read("norm.weight").fp32.abs().max() > 65520
    return root / "u"


def _refused(argv: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "norm.weight" in err and "fp16" in err and "inf" in err, err
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")]


def test_the_cast_refuses_only_what_fp16_turns_to_inf() -> None:
    fits = torch.tensor([1.0, 65519.0, -65519.0, float("inf"), float("nan")])  # rounds to 65504; inf already
    assert torch.equal(narrowed("w", fits, torch.float16)[:3], torch.tensor([1.0, 65504.0, -65504.0]).half())
    for bad in ([1.0, 65520.0], [-7e4, float("nan")], [3e38]):
        with pytest.raises(ConfigError, match="beyond fp16's largest value"):
            narrowed("w", torch.tensor(bad), torch.float16)
    assert narrowed("w", torch.tensor([3e38]), torch.bfloat16).isfinite().all()


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_an_fp16_export_is_refused_and_a_bf16_one_keeps_the_values(big, fmt, tmp_path, capsys) -> None:
    _refused(["export", str(big), str(tmp_path / "m"), "--format", fmt, "--dtype", "fp16"], tmp_path / "m", capsys)
    assert (
        cli(
            [
                "export",
                str(big),
                str(tmp_path / "b.pt" if fmt == "torch" else tmp_path / "b.safetensors"),
                "--format",
                fmt,
                "--dtype",
                "bf16",
            ]
        )
        == 0
    )
    if fmt == "safetensors":
        from safetensors.torch import load_file

        exported = load_file(tmp_path / "b.safetensors")["norm.weight"]
    else:
        exported = torch.load(tmp_path / "b.pt", weights_only=True)["norm.weight"]
    with open_reader(big) as reader:
        assert torch.equal(exported, reader.read("norm.weight").fp32.bfloat16())


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_native_fp16_restore_is_refused_at_every_stage(big, stage, tmp_path, capsys) -> None:
    out = tmp_path / "n"
    _refused(["restore", str(big), str(out), "--dp", "2", "--stage", str(stage), "--dtype", "fp16"], out, capsys)
    assert cli(["restore", str(big), str(out), "--dp", "2", "--stage", str(stage), "--dtype", "bf16"]) == 0


def test_a_plain_fp16_model_is_refused_before_any_weight_changes(big) -> None:
    model = TinyLM(ModelSpec()).half()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match="norm.weight holds"):
        ucp.restore_torch(model, None, big)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    ucp.restore_torch(model.float(), None, big)  # fp32 takes it


@pytest.mark.slow
def test_a_live_deepspeed_fp16_engine_is_refused_in_one_line(big, tmp_path) -> None:
    spec = RunSpec(stage=2, dtype="fp16", dp=2, steps=3)
    with pytest.raises(RankFailure, match="norm.weight holds"):
        resume(
            Built(big, tmp_path / "none.pt", spec), LoadSpec(str(big), kind="ucp"), steps=0, name="live", work=tmp_path
        )
