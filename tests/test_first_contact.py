"""What a new user meets first: the README, the install name, the demo's start, the command line's manners.

The README's first screen is short and says what a machine needs; the distribution has a name of its own; ``ucp
demo`` turns a missing compiler and a killed build's lock into one line; usage errors are one line; ``-q`` and
``-v`` work anywhere on the line (``-v`` times each phase); ``verify --json``; ``diff -q`` prints nothing;
``inspect`` reads a ``--step reset`` output as what it is. Inputs are real DeepSpeed checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import ucp
from tests.support.fixtures import Built
from tests.test_reliability import run_cli
from ucp.cli import main

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def _python(
    *argv: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )


# -- the README ---------------------------------------------------------------------------------
def test_the_readme_first_screen_is_short_and_says_what_a_machine_needs() -> None:
    text = README.read_text()
    first = text[: text.index("\n## What it reads")]
    assert len(first.split()) < 350, len(first.split())
    for needed in ("Python 3.10", "C++ compiler", "disk", "./ucp-demo", "minutes", "download.pytorch.org/whl/cpu"):
        assert needed in first, needed
    # the two commands, exactly as CI and a newcomer run them
    assert "pip install torch==2.13.0 . && ucp demo" in first
    assert 'pip install torch==2.13.0 -e ".[test]" && python -m pytest' in first
    assert "python -m pytest" in (REPO / ".ci" / "run").read_text()


def _anchors(page: Path) -> Iterator[str]:
    """The anchors GitHub makes of a page's headings (lower case, punctuation dropped, spaces to dashes, a repeated
    one numbered)."""
    seen: dict[str, int] = {}
    for title in re.findall(r"^#{1,6} (.+)$", page.read_text(), re.M):
        anchor = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        seen[anchor] = seen.get(anchor, -1) + 1
        yield anchor if seen[anchor] == 0 else f"{anchor}-{seen[anchor]}"


def test_every_link_of_the_readme_and_docs_leads_somewhere() -> None:
    for page in [README, *sorted((REPO / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
            if target.startswith("http"):
                continue
            linked = page.parent / target if target else page
            assert linked.exists(), f"{page.name} links {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in set(_anchors(linked)), f"{page.name} links {target}#{anchor}, which is no heading"


def test_format_md_has_a_table_of_contents_naming_every_section() -> None:
    text = (REPO / "docs" / "format.md").read_text()
    contents = text[text.index("**Contents**") : text.index("\n## 1.")]
    for title in re.findall(r"^## (.+)$", text, re.M):
        assert f"[{title.replace('`', '')}](#" in contents, title


def test_the_distribution_has_a_name_of_its_own_and_every_hint_uses_it() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^name = "ucp-checkpoint"$', pyproject, re.M)
    assert ucp.DISTRIBUTION == "ucp-checkpoint"
    for path in (REPO / "ucp").rglob("*.py"):
        assert not re.search(r"pip install '?ucp\[", path.read_text()), path  # the 2016 `ucp` on the index


def test_ucx_py_files_in_the_same_folder_are_named_in_one_line(tmp_path: Path) -> None:
    """pip puts UCX-Py's `ucp` and ours into one folder; ucp says so when it starts (a copy of the package with
    UCX-Py's core.py and _libs beside it stands for that folder)."""
    site = tmp_path / "site"
    shutil.copytree(REPO / "ucp", site / "ucp", ignore=shutil.ignore_patterns("__pycache__"))
    alone = {"env": {"PYTHONPATH": str(site)}, "cwd": tmp_path}  # not the checkout's own ucp
    assert _python("-m", "ucp", "--version", **alone).stderr == ""  # type: ignore[arg-type]
    (site / "ucp" / "core.py").write_text("# UCX-Py's\n")
    (site / "ucp" / "_libs").mkdir()
    proc = _python("-m", "ucp", "--version", **alone)  # type: ignore[arg-type]
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "UCX-Py" in lines[0] and "virtual environment of its own" in lines[0], proc.stderr
    assert proc.stdout.startswith("ucp ") and proc.returncode == 0


# -- ucp demo's start ---------------------------------------------------------------------------
def test_a_killed_builds_lock_is_named_in_one_line_instead_of_a_hang(tmp_path: Path) -> None:
    root = tmp_path / "ext"
    lock = root / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    start = time.monotonic()
    proc = _python("-m", "ucp", "demo", "--workdir", str(tmp_path / "d"), env={"TORCH_EXTENSIONS_DIR": str(root)})
    assert time.monotonic() - start < 60
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert str(lock) in lines[0] and "rm " in lines[0] and "no process holds it" in lines[0]


def test_a_lock_a_live_build_holds_is_left_to_it(tmp_path: Path) -> None:
    from ucp.harness.ops import stale_locks

    lock = tmp_path / "py311_cpu" / "op" / "lock"
    lock.parent.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import os, time; os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL); time.sleep(60)"]
    )
    try:
        for _ in range(100):
            if lock.exists():
                break
            time.sleep(0.05)
        time.sleep(0.2)
        assert stale_locks(tmp_path, settle=0.1) == []
    finally:
        holder.kill()
        holder.wait()
    assert stale_locks(tmp_path, settle=0.1) == [lock]


def test_without_a_compiler_the_demo_says_what_to_install(tmp_path: Path) -> None:
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "empty"), "CXX": str(tmp_path / "no-such-c++")}
    proc = _python("-m", "ucp", "demo", "--workdir", str(tmp_path / "d"), env=env)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "no C++ compiler" in lines[0] and "apt-get install g++" in lines[0]


# -- the command line's manners -----------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["restore", "a", "b", "--dp", "x"], "ucp restore: error: argument --dp: 'x' is not an integer"),
        (["bogus"], "ucp: error: argument VERB: invalid choice: 'bogus'"),
        (["diff", "a"], "ucp diff: error: the following arguments are required: b"),
    ],
)
def test_a_usage_error_is_one_line_that_says_where_the_help_is(argv: list[str], needle: str) -> None:
    proc = _python("-m", "ucp", *argv)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(needle) and "(see: ucp" in lines[0] and "--help)" in lines[0]


@pytest.fixture(scope="module")
def universal(z3_bf16_dp2: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("universal") / "u"
    ucp.to_universal(z3_bf16_dp2.path, out, workers=1)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("where", ["before", "after"])
def test_quiet_works_anywhere_on_the_line_and_diff_then_prints_nothing(
    z3_bf16_dp2: Built, universal: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    argv = ["diff", str(z3_bf16_dp2.path), str(universal)]
    code = main(["-q", *argv] if where == "before" else [*argv, "-q"])
    out = capsys.readouterr()
    assert code == 0 and out.out == "" and out.err == ""
    code = main([*argv, "--atol", "0"])
    assert code == 0 and "equal: " in capsys.readouterr().out


@pytest.mark.slow
def test_verbose_after_the_verb_times_each_phase(z3_bf16_dp2: Built, tmp_path: Path) -> None:
    proc = _python("-m", "ucp", "to-universal", str(z3_bf16_dp2.path), str(tmp_path / "u"), "-v")
    err = proc.stderr
    assert proc.returncode == 0, err
    timings = re.findall(r"ucp\.timing: (.+): \d+\.\d\d s", err)
    assert any("metadata" in t for t in timings) and any("every parameter" in t for t in timings), err
    assert any(t.startswith("publish") for t in timings) and "ucp to-universal in all" in timings, err


@pytest.mark.slow
def test_verify_json_is_one_object(z3_bf16_dp2: Built, universal: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(z3_bf16_dp2.path), str(universal), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verb"] == "verify" and data["ok"] is True and data["message"].startswith("OK: ")
    assert data["compared"]["parameters"] == 13 and data["compared"]["buffers"] == 1


@pytest.mark.slow
def test_diff_of_identical_checkpoints_takes_the_fast_path_and_is_still_exact(
    z3_bf16_dp2: Built, universal: Path, tmp_path: Path
) -> None:
    report = ucp.diff(z3_bf16_dp2.path, universal)
    assert report.equal and len(report.params) == 13
    assert all(t.max_abs == 0 for p in report.params for t in p.tensors)
    # one moment changed by one ulp shows as a difference, fast path or not
    import torch

    from ucp.model.pieces import Pieces
    from ucp.ops.diff import _tensor_diff  # the per-tensor measure behind the report (over pieces of files)

    def measure(key: str, x: torch.Tensor, y: torch.Tensor):
        return _tensor_diff(key, Pieces.of(x), Pieces.of(y))

    a = torch.randn(1000)
    b = a.clone()
    b[7] = torch.nextafter(b[7], torch.tensor(float("inf")))
    assert measure("exp_avg", a, b).max_abs > 0 and measure("exp_avg", a, a.clone()).max_abs == 0
    nan = torch.tensor([float("nan"), 1.0])
    assert measure("x", nan, nan.clone()).within(0)  # NaNs in the same places are equal


@pytest.mark.slow
def test_inspect_reads_a_step_reset_output_as_a_reset_optimizer(
    z3_bf16_dp2: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "reset"
    code, err = run_cli(capsys, "restore", str(z3_bf16_dp2.path), str(out), "--dp", "1", "--step", "reset")
    assert code == 0, err
    assert main(["inspect", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["optimizer"] == "torch-adam"
    text = " ".join(report["warnings"])
    assert "with the optimizer reset" in text and "was not saved" not in text
    # and a second restore of it says how, in one line
    code, err = run_cli(capsys, "restore", str(out), str(tmp_path / "again"), "--dp", "2")
    assert code == 2 and "--step reset" in err
    code, err = run_cli(capsys, "restore", str(out), str(tmp_path / "again"), "--dp", "2", "--step", "reset")
    assert code == 0, err
