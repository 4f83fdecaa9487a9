"""ucp verify: a universal directory equals its source bit for bit; a model fits a checkpoint's layout."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.support.files import resave
from tests.support.fixtures import build
from ucp.cli import main
from ucp.errors import InputError
from ucp.harness.spec import ModelSpec
from ucp.io import torchfile
from ucp.io.atomic import checksum
from ucp.ops.convert import to_universal
from ucp.ops.verify import first_difference, verify_model, verify_universal
from ucp.universal.reader import UniversalReader

PARAM = "blocks.0.0.weight"


@pytest.fixture(scope="module")
def bf16_universal(z3_bf16_dp2, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verify") / "universal"
    to_universal(z3_bf16_dp2.path, out)
    return out


@pytest.fixture()
def copy(bf16_universal, tmp_path) -> Path:
    out = tmp_path / "universal"
    shutil.copytree(bf16_universal, out)
    return out


def _fix_checksum(root: Path, name: str, key: str) -> None:
    manifest = json.loads((root / "ucp.json").read_text())
    entry = next(p for p in manifest["params"] if p["name"] == name)
    path = root / "zero" / entry["folder"] / key
    entry["files"][key] = {"bytes": path.stat().st_size, "crc32": checksum(path)}
    (root / "ucp.json").write_text(json.dumps(manifest, indent=1))


def _nudge_one_exp_avg(root: Path, index: int) -> tuple[float, float]:
    """Change one element of one exp_avg file to the next float up; return (old, new)."""
    path = root / "zero" / PARAM / "exp_avg.pt"
    obj = torchfile.load(path)
    flat = obj["param"].view(-1)
    old = flat[index].item()
    flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf")))
    resave(obj, path)
    return old, flat[index].item()


@pytest.mark.slow
def test_verify_passes_a_fresh_conversion_bf16_dp2(z3_bf16_dp2, bf16_universal):
    result = verify_universal(z3_bf16_dp2.path, bf16_universal)
    assert result.ok, result.message
    assert result.message.startswith("OK: 13 parameters")


@pytest.mark.slow
def test_verify_passes_a_fresh_conversion_fp32_dp3(z3_fp32_dp3, tmp_path):
    to_universal(z3_fp32_dp3.path, tmp_path / "u")
    assert verify_universal(z3_fp32_dp3.path, tmp_path / "u", tag="global_step3").ok


@pytest.mark.slow
def test_verify_catches_one_changed_exp_avg_value_with_its_checksum_fixed(z3_bf16_dp2, copy):
    old, new = _nudge_one_exp_avg(copy, 37)
    _fix_checksum(copy, PARAM, "exp_avg.pt")
    result = verify_universal(z3_bf16_dp2.path, copy)
    assert not result.ok
    assert result.message.startswith(
        f"MISMATCH: {PARAM} exp_avg: first of 1 differing elements at index [3, 7] (flat 37)"
    )
    assert f"source {old!r} (0x" in result.message and f"universal {new!r} (0x" in result.message


@pytest.mark.slow
def test_verify_catches_one_changed_exp_avg_value_with_a_stale_checksum(z3_bf16_dp2, copy):
    _nudge_one_exp_avg(copy, 0)
    result = verify_universal(z3_bf16_dp2.path, copy)
    assert not result.ok
    assert PARAM in result.message and "exp_avg.pt does not match its checksum" in result.message


@pytest.mark.slow
def test_verify_checks_large_files_checksums_from_the_bytes_it_compares(tmp_path, monkeypatch):
    """Files too large to be read whole when found (over 8 KB) are checked from the bytes the comparison reads, not
    parsed and read a second time: an intact copy verifies without opening one as a torch file, and with one
    file's values intact but its checksum in the manifest wrong, verify still names that file, as a mismatch."""
    big = build(  # the same save as tests/test_reliability.py's (built once for both)
        dp=2, stage=3, dtype="bf16", optimizer="torch-adamw", model=ModelSpec(hidden=256, ffn=512, layers=8), steps=1
    )
    out = tmp_path / "universal"
    to_universal(big.path, out)
    opened: list[Path] = []
    original = UniversalReader._open_tensor

    def counted(self, name, key):
        opened.append(self.file_path(name, key))
        return original(self, name, key)

    monkeypatch.setattr(UniversalReader, "_open_tensor", counted)
    assert verify_universal(big.path, out).ok and opened == []
    manifest = json.loads((out / "ucp.json").read_text())
    entry = max(manifest["params"], key=lambda p: p["files"].get("exp_avg.pt", {}).get("bytes", 0))
    claim = entry["files"]["exp_avg.pt"]
    assert claim["bytes"] > 8192
    claim["crc32"] = f"{int(claim['crc32'], 16) ^ 1:08x}"
    (out / "ucp.json").write_text(json.dumps(manifest, indent=1))
    result = verify_universal(big.path, out)
    assert not result.ok and result.message.startswith("MISMATCH: ")
    assert f"{entry['folder']}/exp_avg.pt does not match its checksum" in result.message


@pytest.mark.slow
def test_verify_catches_a_changed_step_file(z3_bf16_dp2, copy):
    path = copy / "zero" / "norm.bias" / "step.pt"
    resave(torch.tensor(4.0), path)
    assert "step.pt does not match its checksum" in verify_universal(z3_bf16_dp2.path, copy).message
    _fix_checksum(copy, "norm.bias", "step.pt")
    result = verify_universal(z3_bf16_dp2.path, copy)
    assert not result.ok and result.message.startswith("MISMATCH: norm.bias")
    assert "step.pt holds 4.0" in result.message


@pytest.mark.slow
def test_verify_catches_a_changed_frozen_weight_and_a_missing_file(z3_bf16_dp2, copy):
    path = copy / "zero" / "proj.bias" / "fp32.pt"
    obj = torchfile.load(path)
    obj["param"][9] = -obj["param"][9]
    resave(obj, path)
    _fix_checksum(copy, "proj.bias", "fp32.pt")
    result = verify_universal(z3_bf16_dp2.path, copy)
    assert result.message.startswith("MISMATCH: proj.bias fp32: first of 1 differing elements at index [9]")
    (copy / "zero" / "blocks.1.0.bias" / "exp_avg_sq.pt").unlink()
    result = verify_universal(z3_bf16_dp2.path, copy)
    assert not result.ok and "blocks.1.0.bias" in result.message and "exp_avg_sq.pt is missing" in result.message


@pytest.mark.slow
def test_verify_catches_a_changed_buffer(z3_bf16_dp2, copy):
    state = torchfile.load(copy / "state.pt")
    state["buffers"]["calls"][1] += 1
    resave(state, copy / "state.pt")
    assert "state.pt does not match its checksum" in verify_universal(z3_bf16_dp2.path, copy).message
    manifest = json.loads((copy / "ucp.json").read_text())
    manifest["files"]["state.pt"] = {"bytes": (copy / "state.pt").stat().st_size, "crc32": checksum(copy / "state.pt")}
    (copy / "ucp.json").write_text(json.dumps(manifest))
    result = verify_universal(z3_bf16_dp2.path, copy)
    assert result.message.startswith("MISMATCH: buffer calls: first of 1 differing elements at index [1]")


@pytest.mark.slow
def test_verify_fails_on_a_damaged_manifest(z3_bf16_dp2, copy):
    manifest = json.loads((copy / "ucp.json").read_text())
    del manifest["params"][0]["folder"]
    (copy / "ucp.json").write_text(json.dumps(manifest))
    result = verify_universal(z3_bf16_dp2.path, copy)
    assert not result.ok and "ucp.json is malformed" in result.message


def test_verify_compares_bits_not_values():
    assert first_difference(torch.tensor([0.0]), torch.tensor([-0.0])) == (
        "first of 1 differing elements at index [0] (flat 0): source 0.0 (0x00000000), universal -0.0 (0x80000000)"
    )
    nan = torch.tensor([float("nan")])
    assert first_difference(nan, nan.clone()) is None
    assert first_difference(torch.zeros(2), torch.zeros(2, dtype=torch.bfloat16)).startswith("dtype")


@pytest.mark.slow
def test_verify_cli_exit_codes(z3_bf16_dp2, bf16_universal, copy, tmp_path, capsys):
    assert main(["verify", str(z3_bf16_dp2.path), str(bf16_universal)]) == 0
    assert capsys.readouterr().out.startswith("OK:")
    _nudge_one_exp_avg(copy, 5)
    assert main(["verify", str(z3_bf16_dp2.path), str(copy)]) == 1
    assert PARAM in capsys.readouterr().out
    assert main(["verify", str(z3_bf16_dp2.path), str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ucp: error:") and len(err.strip().splitlines()) == 1
    assert main(["verify", str(z3_bf16_dp2.path)]) == 2
    assert "needs UNIVERSAL" in capsys.readouterr().err


@pytest.mark.slow
def test_verify_cli_in_a_subprocess(z3_bf16_dp2, bf16_universal, tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "ucp", "verify", str(z3_bf16_dp2.path), str(bf16_universal)],
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and ok.stdout.startswith("OK:"), ok.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "ucp", "verify", str(tmp_path), str(bf16_universal)], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().startswith("ucp: error:") and len(bad.stderr.strip().splitlines()) == 1


# -- verify --model ---------------------------------------------------------------------------
MODELS = textwrap.dedent("""
    from ucp.harness.model import TinyLM
    from ucp.harness.spec import ModelSpec

    def build():
        return TinyLM(ModelSpec())

    def untied():
        return TinyLM(ModelSpec(tied=False))

    def wider():
        return TinyLM(ModelSpec(ffn=24))

    def unfrozen():
        model = TinyLM(ModelSpec())
        model.proj.requires_grad_(True)
        return model

    def norm_first():
        model = TinyLM(ModelSpec())
        children = dict(model._modules)
        model._modules.clear()
        for name in ("embed", "norm", "blocks", "proj", "head"):
            model._modules[name] = children[name]
        return model

    def not_a_model():
        return 42
""")


@pytest.fixture()
def models(tmp_path, monkeypatch) -> str:
    (tmp_path / "ucp_test_models.py").write_text(MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "ucp_test_models", raising=False)
    return "ucp_test_models"


@pytest.mark.slow
def test_verify_model_accepts_the_model_that_wrote_the_checkpoint(z3_bf16_dp2, models, bf16_universal):
    result = verify_model(z3_bf16_dp2.path, f"{models}:build")
    assert result.ok and "13 parameters (2 frozen) in 2 groups, 1 tied" in result.message
    assert verify_model(bf16_universal, f"{models}.py:build").ok  # a file path works too
    assert verify_model(z3_bf16_dp2.path, f"{models}:build", tag="global_step3").ok


@pytest.mark.parametrize(
    "builder, expected",
    [
        (
            "untied",
            "MISMATCH: model parameter 'head.weight' holds its own data, but the checkpoint ties it to 'embed.weight'",
        ),
        ("wider", "MISMATCH: blocks.0.0.weight: model shape [24, 10], checkpoint shape [23, 10]"),
        ("unfrozen", "MISMATCH: proj.weight: trainable in the model, frozen in the checkpoint"),
        (
            "norm_first",
            "MISMATCH: param group 1: order differs at position 0: the checkpoint stores 'blocks.0.0.bias', "
            "the model has 'norm.weight' there",
        ),
    ],
)
@pytest.mark.slow
def test_verify_model_names_the_first_mismatch(z3_bf16_dp2, models, builder, expected):
    result = verify_model(z3_bf16_dp2.path, f"{models}:{builder}")
    assert not result.ok and result.message.startswith(expected), result.message


@pytest.mark.slow
def test_verify_model_bad_spec_is_an_input_error(z3_bf16_dp2, models, capsys):
    for spec, words in [
        ("nocolon", "MODULE:CALLABLE"),
        (f"{models}:missing", "has no attribute"),
        ("no_such_module_xyz:build", "cannot import"),
        (f"{models}:not_a_model", "not a torch.nn"),
    ]:
        with pytest.raises(InputError, match=words):
            verify_model(z3_bf16_dp2.path, spec)
    assert main(["verify", str(z3_bf16_dp2.path), "--model", f"{models}:wider"]) == 1
    assert "model shape [24, 10]" in capsys.readouterr().out
    assert main(["verify", str(z3_bf16_dp2.path), "--model", f"{models}:missing"]) == 2


def test_pieces_are_compared_a_chunk_at_a_time_with_the_whole_tensors_message(tmp_path, monkeypatch) -> None:
    """verify reads both sides as pieces and compares them in bounded chunks (a 4 GB state is never whole in
    memory): the verdict and the message, first difference and count across chunks, are the whole tensors'."""
    from ucp.model.pieces import PathSpan, Pieces, file_stamp
    from ucp.ops import verify

    a = torch.randn(3, 1001, generator=torch.Generator().manual_seed(0))
    b = a.clone()
    b.view(-1)[[1500, 1501, 2999]] = torch.tensor([1.0, -0.0, float("nan")])  # in the second and last chunks
    path = tmp_path / "a.bin"
    path.write_bytes(b"pad" + a.numpy().tobytes())
    spans = Pieces((PathSpan(str(path), 3, 4 * a.numel(), file_stamp(path.stat())),), tuple(a.shape), torch.float32)
    halves = Pieces((b.reshape(-1)[:1700].clone(), b.reshape(-1)[1700:].clone()), tuple(b.shape), torch.float32)
    monkeypatch.setattr(verify, "_COMPARE_CHUNK", 1000)
    whole = first_difference(a, b)
    assert whole is not None and whole.startswith("first of 3 differing elements at index [1, 499] (flat 1500)")
    assert verify.first_difference_pieces(spans, halves) == whole
    assert verify.first_difference_pieces(spans, Pieces.of(a.clone())) is None
    assert verify.first_difference_pieces(spans, Pieces.of(a.reshape(-1))).startswith("shape differs")
