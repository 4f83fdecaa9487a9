"""Every shell example in README.md and docs/cli.md runs, on real checkpoints, as the docs write it.

Each ```bash / ```sh / ```console block runs in a fresh folder (a "world") where the names the docs
use exist: ``checkpoints/run`` and ``CKPT`` are a real DeepSpeed ZeRO-3 checkpoint, ``run-universal``
and ``UNIVERSAL`` its universal directory, ``out/checkpoint-500`` a real Hugging Face Trainer folder,
``configs/`` the repository's migration examples, and so on (:data:`NAMES`); tags the docs invent
(``global_step1000``) become the checkpoint's own. Every line is an example of its own: it runs in a
world of its own, where every name but its OUT exists, in-process through ``ucp.cli.main``, and must
exit 0, or the code a trailing ``# exit N`` gives. Synopsis options in brackets (``[--json]``) are dropped, after
checking that the verb has them. A ``console`` block's ``$`` lines are commands and the lines under
them their output: each one shown (but ``...``) must be printed. Lines that cannot run here are in
:data:`SKIP`, with the reason; any other line must be a ucp command that runs.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from ucp.cli import build_parser
from ucp.cli import main as cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/cli.md")
SHELLS = ("bash", "sh", "shell", "console")

#: lines (as written, comment dropped) that cannot run in a test, and why; a stale entry fails the suite
SKIP = {
    "pip install torch==2.13.0 . && ucp demo": "installs packages, then trains real DeepSpeed runs for minutes",
    'pip install torch==2.13.0 -e ".[test]" && python -m pytest': "the whole test suite, this test included",
    "ucp demo": "trains real DeepSpeed runs on 4 CPU ranks for minutes (the demo's folder rules: test_reliability2)",
    "ucp demo --workdir /tmp/demo --source-dp 3 --target-dp 2": "trains real DeepSpeed runs, as ucp demo",
    "torchrun --nproc-per-node 8 -m ucp to-universal checkpoints/run run-universal --distributed": "8 ranks under "
    "torchrun (--distributed is tested on spawned ranks in tests/test_distributed.py)",
    "torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr HOST0 -m ucp restore run-universal ckpt-dp64 "
    "--dp 64 --distributed": "2 nodes under torchrun (tests/test_distributed.py runs 2 nodes x 2 on one machine)",
}

#: name in the docs -> what it is in the world; outputs the docs create are not listed
NAMES = {
    "ckpt": ("CKPT", "A", "checkpoints/run", "ckpt_dp8", "checkpoints/run-dp8", "resumed", "native"),
    "universal": ("UNIVERSAL", "B", "CKPT_OR_UNIVERSAL", "run-universal"),
    "restored": ("restored_dp4",),
    "tp_universal": ("tp-universal",),  # of a run saved with TP=2: its rules let a restore cut it again
    "trainer": ("out/checkpoint-500",),
    "megatron": ("MEGATRON_RUN",),
}
#: tags the docs make up -> the world checkpoint's own
TAGS = ("global_step1000", "global_step600")

MODEL = """
from ucp.harness.model import TinyLM
from ucp.harness.spec import ModelSpec


def {name}():
    return TinyLM(ModelSpec())
"""


@dataclass
class Line:
    """One command of a block: where it is, its text, its expected exit code and output."""

    doc: str
    number: int
    text: str
    code: int = 0
    output: list[str] = field(default_factory=list)


def _blocks() -> Iterator[tuple[str, list[Line]]]:
    """(doc:line, commands) for every shell block of the docs."""
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            if match.group(1) in SHELLS:
                start = text[: match.start()].count("\n") + 2
                lang, body = match.group(1), match.group(2)
                yield f"{doc}:{start - 1}", _lines(doc, start, body, lang == "console")


def _lines(doc: str, start: int, body: str, console: bool) -> list[Line]:
    lines: list[Line] = []
    pending = ""
    for offset, raw in enumerate(body.splitlines()):
        if console and not raw.startswith("$ "):
            if lines and raw.strip():
                lines[-1].output.append(raw)
            continue
        raw = raw[2:] if console else raw
        pending += raw.rstrip("\\")
        if raw.endswith("\\"):
            continue
        text, pending = pending.strip(), ""
        if text and not text.startswith("#"):
            command, _, comment = _split_comment(text)
            exit_code = re.search(r"\bexit (\d+)\b", comment)
            lines.append(Line(doc, start + offset, command, int(exit_code.group(1)) if exit_code else 0))
    return lines


def _split_comment(text: str) -> tuple[str, str, str]:
    """(command, '#', comment): the first # outside quotes starts the comment."""
    quote = None
    for i, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].strip(), "#", text[i + 1 :].strip()
    return text.strip(), "", ""


BLOCKS = dict(_blocks())


# -- the world ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world_sources(z3_bf16_dp2, universals, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The real checkpoints the world's names copy."""
    import ucp

    restored = tmp_path_factory.mktemp("docs") / "restored"
    ucp.write_native(z3_bf16_dp2.path, restored, dp=4)
    return {
        "ckpt": z3_bf16_dp2.path,
        "universal": universals("z3-bf16-dp2-adamw"),
        "restored": restored,
        "tp_universal": universals("tp2-z2-fp32-dp1"),
    }


def _trainer_folder() -> Path:
    """A Trainer checkpoint saved at 2 processes (built once by tests/test_hf.py's cache)."""
    pytest.importorskip("transformers")
    from tests.support.hf_runs import SAVED_AT, cached_run
    from tests.support.hf_worker import HfSpec

    return cached_run("trainer-z3-save", HfSpec(world=2, stage=3)).out / f"checkpoint-{SAVED_AT}"


def _megatron_run() -> Path:
    """A Megatron-Core run folder (built once by tests/test_megatron.py's cache)."""
    import importlib.util

    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    from tests.support.megatron_runs import cached_run, save_spec

    run = cached_run("tp1dp2-dpr", save_spec(1, 1, 2, "dp_reshardable"))
    assert run.out is not None
    return run.out


def _build_world(root: Path, sources: dict[str, Path], argv: list[str]) -> None:
    """Lay out in ``root`` every name of :data:`NAMES` but the line's OUT, the configs, two model
    builders and a migration file."""
    out = getattr(build_parser().parse_args(argv), "out", None)
    for kind, names in NAMES.items():
        for name in names:
            if name != out and kind in sources:
                (root / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copytree(sources[kind], root / name, symlinks=True)
    shutil.copytree(ROOT / "configs", root / "configs")
    (root / "mypkg").mkdir()
    (root / "mypkg" / "__init__.py").write_text("")
    (root / "mypkg" / "model.py").write_text(MODEL.format(name="build"))
    (root / "train.py").write_text(MODEL.format(name="make_model"))
    (root / "move.yaml").write_text("source: out/checkpoint-500\ntarget: {dp: 3, output: moved/checkpoint-500}\n")


# -- running a line -----------------------------------------------------------------------------
def _argv(line: Line, tags: dict[str, str]) -> tuple[list[str], list[str]]:
    """(ucp's argv, a jq filter's argv or []) of a line; bracketed options dropped once checked."""
    command, _, pipe = line.text.partition(" | ")
    optional = re.findall(r"\s(\[--(?:[^\[\]]|\[[^\]]*\])*\])", command)
    for group in optional:
        command = command.replace(group, "")
    words = shlex.split(command)
    if words[:3] == ["python", "-m", "ucp"]:
        words = words[2:]
    assert words[0] == "ucp", f"{line.doc}:{line.number}: not a ucp command: run it here or add it to SKIP"
    words = ["/".join(tags.get(part, part) for part in word.split("/")) for word in words[1:]]
    _check_options(line, words, optional)
    jq = shlex.split(pipe) if pipe else []
    assert not jq or jq[0] == "jq", f"{line.doc}:{line.number}: only `| jq` pipes are run"
    return words, jq


def _check_options(line: Line, words: list[str], optional: list[str]) -> None:
    """Every bracketed option of a synopsis line is an option of its verb."""
    verbs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    verb = next((w for w in words if w in verbs.choices), None)
    assert verb is not None, f"{line.doc}:{line.number}: no verb in {line.text!r}"
    known = verbs.choices[verb]._option_string_actions
    for flag in re.findall(r"--[\w-]+", " ".join(optional)):
        assert flag in known, f"{line.doc}:{line.number}: ucp {verb} has no {flag}"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = cli(argv)
    except SystemExit as done:  # argparse's usage errors
        code = done.code if isinstance(done.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def _jq(words: list[str], text: str) -> str:
    """The jq of the docs; with no jq installed, its simple paths (``.a[].b``) evaluated here."""
    if shutil.which("jq"):
        done = subprocess.run(["jq", *words[1:]], input=text, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout
    values: list[Any] = [json.loads(text)]
    for part in re.findall(r"\.(\w+)|(\[\])", words[-1]):
        values = [v[part[0]] for v in values] if part[0] else [x for v in values for x in v]
    return "\n".join(json.dumps(v) for v in values)


def _shown(expected: list[str], out: str) -> list[str]:
    """The lines the docs show that the command did not print (whitespace and DeepSpeed's version aside:
    the fixtures are rebuilt by whichever DeepSpeed is installed)."""

    def norm(line: str) -> str:
        return re.sub(r"DeepSpeed \d+(\.\d+)+", "DeepSpeed X", " ".join(line.split()))

    printed = {norm(line) for line in out.splitlines()}
    return [line for line in expected if line.strip() != "..." and norm(line) not in printed]


# -- the tests ----------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("where", list(BLOCKS))
def test_every_shell_example_of_the_docs_runs(where, world_sources, tmp_path, monkeypatch, capsys):
    lines = [line for line in BLOCKS[where] if line.text not in SKIP]
    if not lines:
        pytest.skip("every line is in SKIP: " + "; ".join(SKIP[line.text] for line in BLOCKS[where]))
    tags = dict.fromkeys(TAGS, (world_sources["ckpt"] / "latest").read_text().strip())
    sources = dict(world_sources)
    if any(needs in line.text for line in lines for needs in ("checkpoint-500", "move.yaml")):
        sources["trainer"] = _trainer_folder()
    if any("MEGATRON_RUN" in line.text for line in lines):
        sources["megatron"] = _megatron_run()
    for i, line in enumerate(lines):  # each line an example of its own, in a world of its own
        argv, jq = _argv(line, tags)
        world = tmp_path / f"line{i}"
        world.mkdir()
        _build_world(world, sources, argv)
        monkeypatch.chdir(world)
        monkeypatch.syspath_prepend(str(world))  # `--model mypkg.model:build` imports from here
        code, out, err = _run(argv, capsys)
        assert code == line.code, f"{line.doc}:{line.number}: {line.text!r} exited {code}:\n{err}"
        if jq:
            assert _jq(jq, out).strip(), f"{line.doc}:{line.number}: {line.text!r} printed nothing"
        missing = _shown(line.output, out)
        assert not missing, f"{line.doc}:{line.number}: {line.text!r} did not print {missing}; it printed:\n{out}"
        for module in ("mypkg", "mypkg.model", "train"):
            sys.modules.pop(module, None)


@pytest.mark.slow
def test_the_skip_list_names_only_lines_the_docs_have_and_the_docs_have_examples():
    written = {line.text for lines in BLOCKS.values() for line in lines}
    assert not set(SKIP) - written, f"SKIP names lines no doc has any more: {set(SKIP) - written}"
    assert len(BLOCKS) >= 10 and all(BLOCKS.values()), textwrap.shorten(str(BLOCKS), 200)


def test_a_console_block_shows_its_output_and_a_failing_line_is_caught():
    body = "$ ucp inspect run-universal\nrun-universal: universal directory\n...\n$ ucp diff A B  # exit 1\n"
    lines = _lines("x.md", 1, body, console=True)
    assert [(line.text, line.code, line.output) for line in lines] == [
        ("ucp inspect run-universal", 0, ["run-universal: universal directory", "..."]),
        ("ucp diff A B", 1, []),
    ]
    assert _shown(lines[0].output, "run-universal:  universal directory\nmore\n") == []
    assert _shown(lines[0].output, "other\n") == ["run-universal: universal directory"]
    synopsis = "ucp restore U OUT/global_step600 --dp 8 [--stage 1|2|3] [--overwrite [--overwrite-foreign]]"
    assert _argv(Line("x.md", 1, synopsis), {"global_step600": "t"}) == (["restore", "U", "OUT/t", "--dp", "8"], [])
    with pytest.raises(AssertionError, match="ucp restore has no --nope"):
        _argv(Line("x.md", 1, "ucp restore U OUT --dp 8 [--nope]"), {})
