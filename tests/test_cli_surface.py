"""The CLI as people script it: --version, no abbreviated options, help for every option, the optimizer names
it takes, a closed pipe and an early Ctrl-C ending without a traceback, and a start that does not wait for torch."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ucp
from tests.support.checks import assert_adam_universal_matches_record
from ucp.cli import DCP_OPTIMIZER_NAMES, FLAVOUR_NAMES, build_parser
from ucp.cli import main as cli
from ucp.io.atomic import PARTIAL_MARK

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _ucp(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ucp", *args], env=ENV, text=True, **kwargs)


def test_version_and_no_abbreviated_options(capsys):
    with pytest.raises(SystemExit) as done:
        cli(["--version"])
    assert capsys.readouterr().out.strip() == f"ucp {ucp.__version__} (distribution {ucp.DISTRIBUTION})"
    assert done.value.code == 0
    with pytest.raises(SystemExit) as done:
        cli(["restore", "a", "b", "--dp", "2", "--over"])
    assert done.value.code == 2 and "unrecognized arguments: --over" in capsys.readouterr().err


def _documented_flags() -> dict[str, set[str]]:
    """Per verb, the flags docs/cli.md's option tables name (``--offload`` / ``--no-offload`` rows name both)."""
    import re

    text = (ROOT / "docs" / "cli.md").read_text()
    flags: dict[str, set[str]] = {}
    for section in re.split(r"^## ucp ", text, flags=re.M)[1:]:
        verb = section.split("\n", 1)[0].strip()
        cells = [re.split(r"(?<!\\)\|", line)[1] for line in section.splitlines() if line.startswith("| `")]
        flags[verb] = {f for cell in cells for f in re.findall(r"`(--[a-z][a-z0-9-]*)", cell)}
    return flags


def test_docs_cli_lists_exactly_the_flags_each_verb_takes():
    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    documented = _documented_flags()
    everywhere = {"--help", "--debug", "--verbose", "--quiet"}  # documented once, under "Global options"
    for verb, sub in verbs.items():
        taken = {o for a in sub._actions for o in a.option_strings if o.startswith("--")} - everywhere
        # reshard takes restore's flags but the output format (the docs say so instead of repeating the table)
        want = documented["restore"] - {"--format", "--dcp-layout"} if verb == "reshard" else documented[verb]
        assert taken == want, (
            f"{verb}: undocumented {sorted(taken - want)}, documented but not taken {sorted(want - taken)}"
        )


def test_every_option_has_help_and_the_optimizer_names_are_the_registrys():
    from ucp.model.flavours import FLAVOURS
    from ucp.targets.dcp import DCP_OPTIMIZERS

    assert FLAVOUR_NAMES == tuple(FLAVOURS) and set(DCP_OPTIMIZER_NAMES) == set(DCP_OPTIMIZERS)
    parser = build_parser()
    verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in verbs.choices.items():
        missing = [a.option_strings or a.dest for a in sub._actions if not a.help]
        assert not missing, (name, missing)


def test_the_cli_starts_without_importing_torch():
    code = "import sys, ucp.cli; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], env=ENV, check=True, timeout=60)


def test_every_door_is_one_entry():
    """The ``ucp`` command, ``python -m ucp`` and ``python -m ucp.cli`` all run ``ucp.__main__.run``, which owns
    what a stop signal does before and after the verb (the tests below drive ``python -m ucp``)."""
    from importlib.metadata import entry_points

    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "ucp"]
    assert script.value == "ucp.__main__:run"
    for module in ("ucp", "ucp.cli"):
        done = subprocess.run([sys.executable, "-m", module, "--version"], env=ENV, capture_output=True, text=True)
        assert done.returncode == 0 and done.stdout.startswith("ucp "), done


@pytest.mark.slow
def test_a_pipe_closed_early_ends_without_a_traceback(z3_bf16_dp2):
    proc = _ucp("inspect", str(z3_bf16_dp2.path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # `| head -0`: gone before ucp writes (a reader leaving later may find it all written)
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err and err == "", err


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.05, 0.3])
def test_an_early_ctrl_c_is_one_line_without_a_traceback(z3_bf16_dp2, tmp_path, delay):
    """While Python starts the CLI, or while torch is imported (a signal there once broke numpy's import and
    was swallowed, so the run went on). A signal that lands before the interpreter has even imported
    ``site`` (no ucp code has run; CPython itself fails with "Fatal Python error: init_import_site"), or
    while ``site`` runs the environment's ``.pth`` files (a traceback in ``<frozen site>``), is outside the
    CLI's reach: that attempt is repeated a little later. A run that finished before the signal (a machine
    fast enough to import torch and convert within the delay) is repeated sooner."""
    wait = delay
    for _ in range(6):
        proc = _ucp("to-universal", str(z3_bf16_dp2.path), str(tmp_path / "u"), stderr=subprocess.PIPE)
        time.sleep(wait)
        proc.send_signal(signal.SIGINT)
        err = proc.stderr.read()
        code = proc.wait(timeout=120)
        if code == 0:  # done before the signal came: whole, and nothing said
            assert err == "" and (tmp_path / "u" / "ucp.json").is_file(), err
            shutil.rmtree(tmp_path / "u")
            wait /= 2
        elif "init_import_site" in err or "<frozen site>" in err:
            wait += 0.05
        else:
            break
    assert code == 130, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "u").exists()


def _signal_when(proc: subprocess.Popen, ready, signum: int = signal.SIGINT, after: float = 0.0) -> tuple[int, str]:
    """Send ``signum`` ``after`` seconds past the moment ``ready()`` holds (polled every half millisecond); the
    exit code and stderr."""
    deadline = time.monotonic() + 120
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    time.sleep(after)
    proc.send_signal(signum)  # a no-op once the process has been reaped
    err = proc.stderr.read()
    return proc.wait(timeout=120), err


@pytest.mark.slow
def test_a_ctrl_c_while_the_output_is_written_removes_it_with_one_line(z3_bf16_dp2, tmp_path):
    """The signal is sent once the staging folder exists, so the work has begun (a fixed delay, the test's
    first form, let a fast machine finish first). A run that still finished first is repeated."""
    out = tmp_path / "u"

    def staging() -> bool:
        return any(name.startswith(f".u{PARTIAL_MARK}") for name in os.listdir(tmp_path))

    for _ in range(8):
        proc = _ucp("to-universal", str(z3_bf16_dp2.path), str(out), stderr=subprocess.PIPE, stdout=subprocess.PIPE)
        code, err = _signal_when(proc, staging)
        if code == 130:
            break
        assert code == 0 and err == "" and (out / "ucp.json").is_file(), (code, err)
        shutil.rmtree(out)
    assert code == 130, "every run finished before the signal landed"
    assert "Traceback" not in err and err.strip().splitlines() == [
        "ucp: interrupted by SIGINT; nothing was left half-written"
    ], err
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_signal_after_the_output_is_published_leaves_it_whole(z3_bf16_dp2, tmp_path, signum):
    """Once OUT is published a late signal changes nothing: the run ends as done (exit 0, nothing said), or,
    if it landed while the CLI was still printing its result, with the stopped line, but never with a claim that
    nothing was written (the start-up handler, given back after the verb), a traceback, or death by the signal
    while Python shuts down (what CI once saw, exit status -2)."""
    out = tmp_path / "u"
    for after in (0.0, 0.003, 0.01, 0.03, 0.06):  # on this machine: printing the result, the CLI's return, shutdown
        proc = _ucp("to-universal", str(z3_bf16_dp2.path), str(out), stderr=subprocess.PIPE, stdout=subprocess.PIPE)
        code, err = _signal_when(proc, out.exists, signum, after)
        stopped = f"ucp: interrupted by {signal.Signals(signum).name}; nothing was left half-written"
        assert (code, err) == (0, "") or (code == 128 + signum and err.strip() == stopped), (after, code, err)
        assert (out / "ucp.json").is_file() and [p.name for p in tmp_path.iterdir()] == ["u"]
        assert_adam_universal_matches_record(out, z3_bf16_dp2.record)
        shutil.rmtree(out)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["text", "json", "quiet"])
def test_results_go_to_stdout_as_one_line_one_json_object_or_nothing(z3_bf16_dp2, tmp_path, capsys, mode):
    flags = {"text": [], "json": ["--json"], "quiet": []}[mode]
    top = ["--quiet"] if mode == "quiet" else []
    runs = [
        ["to-universal", str(z3_bf16_dp2.path), str(tmp_path / "u")],
        ["restore", str(tmp_path / "u"), str(tmp_path / "n"), "--dp", "3"],
        ["restore", str(tmp_path / "u"), str(tmp_path / "d"), "--format", "dcp"],
        ["export", str(tmp_path / "u"), str(tmp_path / "model.safetensors")],
    ]
    for argv in runs:
        assert cli(top + argv + flags) == 0, argv
        out, err = capsys.readouterr()
        if mode == "quiet":
            assert out == "" and err == "", (argv, out, err)
        elif mode == "json":
            result = json.loads(out)
            assert result["verb"] == argv[0] and Path(result["out"]) == Path(argv[2]) and result["summary"], result
            assert err == "", err
        else:
            assert len(out.splitlines()) == 1 and out.startswith("wrote "), out
            assert all(line.startswith("note: ") for line in err.splitlines()), err


@pytest.mark.parametrize(
    ("dp", "advice"),
    [
        (2, None),
        (4, "to keep 12 set train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=1"),
        (5, "no setting keeps 12 at 5 processes"),
    ],
)
@pytest.mark.slow
def test_a_restore_at_another_dp_says_which_batch_settings_keep_the_global_batch(
    z3_bf16_dp2, tmp_path, capsys, dp, advice
):
    assert cli(["restore", str(z3_bf16_dp2.path), str(tmp_path / "n"), "--dp", str(dp), "--json"]) == 0
    notes = [n for n in json.loads(capsys.readouterr().out)["notes"] if "global batch" in n]
    assert notes == [] if advice is None else len(notes) == 1 and advice in notes[0], notes


def test_each_line_ucp_says_on_stderr_is_one_write(monkeypatch, tmp_path):
    """The processes of a --distributed run share their launcher's stderr: a line written as text, then newline (as
    print does) ran into another process's line in CI (PYTHONUNBUFFERED=1), and a line was lost to the reader."""
    import io

    writes: list[str] = []

    class Recorder(io.StringIO):
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

    monkeypatch.setattr(sys, "stderr", Recorder())
    assert cli(["inspect", str(tmp_path / "missing")]) != 0
    assert any(w.startswith("ucp: error: ") for w in writes), writes
    assert all(w.endswith("\n") for w in writes), writes
