"""Issue 7: what ucp promises when its input is damaged, hostile or interrupted.

Every damaged checkpoint here starts as a real DeepSpeed checkpoint (conftest fixtures), copied to
tmp_path and broken one way; rank files are re-saved with ucp's own writer (tests.support.files.resave) so DeepSpeed's class
names stay as DeepSpeed wrote them. Errors are checked through the CLI: a non-zero exit and exactly
one line on stderr.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.support.files import resave
from tests.support.fixtures import Built, build
from ucp.cli import main
from ucp.errors import CorruptFileError, InputError
from ucp.harness.spec import ModelSpec
from ucp.io import standins, torchfile
from ucp.io.atomic import PARTIAL_MARK
from ucp.ops.convert import to_universal
from ucp.universal.manifest import MANIFEST, folder_for
from ucp.universal.reader import UniversalReader

REPO = Path(__file__).resolve().parent.parent


# -- helpers ----------------------------------------------------------------------------------
def copy_checkpoint(built: Built, dest: Path) -> Path:
    """A private copy of a fixture checkpoint (the folder holding `latest`)."""
    shutil.copytree(built.path, dest)
    return dest


def tag_dir(ckpt: Path) -> Path:
    return ckpt / (ckpt / "latest").read_text().strip()


def optim_file(ckpt: Path, rank: int) -> Path:
    return next(tag_dir(ckpt).glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))


def model_file(ckpt: Path, rank: int) -> Path:
    return tag_dir(ckpt) / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def edit(path: Path, change: Callable[[Any], None]) -> None:
    """Load a rank file, change it in place, and save it back under DeepSpeed's class names."""
    obj = torchfile.load(path)
    change(obj)
    resave(obj, path)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, *needles: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith("ucp: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def assert_absent_or_whole(out: Path) -> str:
    """The invariant after any interruption: no OUT, or one whose every parameter reads back checked."""
    if not out.exists():
        return "absent"
    assert (out / MANIFEST).is_file(), f"{out} exists without {MANIFEST}"
    reader = UniversalReader(out, verify=True)
    for entry in reader.entries():
        state = reader.read(entry.name)
        assert tuple(state.fp32.shape) == tuple(entry.shape)
    reader.buffers()
    return "whole"


def digests(root: Path) -> dict[str, tuple[str, int]]:
    return {
        str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


# -- names become folders ---------------------------------------------------------------------
def _decode_folder(folder: str) -> str | None:
    """Invert folder_for's percent-encoding (None for the hashed form of over-long names)."""
    if "%~" in folder:
        return None
    out = bytearray()
    i = 0
    while i < len(folder):
        if folder[i] == "%":
            out += bytes([int(folder[i + 1 : i + 3], 16)])
            i += 3
        else:
            out += folder[i].encode()
            i += 1
    return out.decode()


def _assert_safe_component(folder: str) -> None:
    assert folder and folder not in (".", "..") and not folder.startswith(".")
    assert "/" not in folder and "\\" not in folder and "\x00" not in folder
    assert len(folder.encode()) <= 255
    assert all(c.isascii() and (c.isalnum() or c in "_.-%~") for c in folder), folder


NASTY_NAMES = [
    "..",
    ".",
    "../evil",
    "/etc/passwd",
    "a/../../b",
    "x\\y",
    ".hidden",
    "-rf",
    "%2E%2E",
    "%",
    "~",
    "a" * 300,
    "ü" * 120,
    "model.layers.0.weight",
    "CON",
    "a b",
    "\u202eevil",
    "\t",
]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.lists(st.text(min_size=1, max_size=260).filter(lambda s: "\x00" not in s), min_size=2, max_size=6, unique=True)
)
@example(NASTY_NAMES)
@example(["a" * 300, "a" * 301])
@example(["a" * 150 + "b" * 100, "a" * 150 + "c" * 100])
def test_folder_for_is_injective_and_always_one_safe_path_component(names: list[str]) -> None:
    folders = [folder_for(n) for n in names]
    assert len(set(folders)) == len(folders)
    for name, folder in zip(names, folders):
        _assert_safe_component(folder)
        decoded = _decode_folder(folder)
        if decoded is None:  # the hashed form: only for a name whose encoding (3 chars a byte at most) is over-long
            assert 3 * len(name.encode()) > 200 and folder.endswith("%~" + hashlib.sha1(name.encode()).hexdigest())
        else:
            assert decoded == name


@pytest.mark.parametrize("name", ["", "a\x00b"])
def test_folder_for_refuses_empty_and_nul_names(name: str) -> None:
    with pytest.raises(InputError):
        folder_for(name)


@pytest.fixture(scope="module")
def universal(z3_bf16_dp2: Built, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("universal") / "u"
    to_universal(z3_bf16_dp2.path, out, workers=1)
    return out


def _with_folder(universal: Path, dest: Path, folder: Any) -> Path:
    shutil.copytree(universal, dest)
    manifest = json.loads((dest / MANIFEST).read_text())
    manifest["params"][0]["folder"] = folder
    (dest / MANIFEST).write_text(json.dumps(manifest))
    return dest


@pytest.mark.parametrize(
    "folder",
    [
        "../evil",
        "/etc",
        "..",
        ".",
        "",
        "a/b",
        "x/../../y",
        "a\x00b",
    ],
)
@pytest.mark.slow
def test_universal_reader_refuses_a_folder_outside_zero(universal: Path, tmp_path: Path, folder: str) -> None:
    (tmp_path / "evil").mkdir()
    with pytest.raises(CorruptFileError, match="outside zero/"):
        UniversalReader(_with_folder(universal, tmp_path / "u", folder))


@pytest.mark.slow
def test_universal_reader_refuses_a_symlinked_folder_leading_out(universal: Path, tmp_path: Path) -> None:
    dest = _with_folder(universal, tmp_path / "u", "escape")
    (tmp_path / "elsewhere").mkdir()
    (dest / "zero" / "escape").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CorruptFileError, match="outside zero/"):
        UniversalReader(dest)


# -- one-line errors through the CLI ----------------------------------------------------------
def _missing_rank(ckpt: Path) -> None:
    optim_file(ckpt, 1).unlink()


def _missing_last_rank(ckpt: Path) -> None:
    optim_file(ckpt, 1).unlink()
    model_file(ckpt, 1).unlink()


def _absurd_rank_number(ckpt: Path) -> None:
    for path in (optim_file(ckpt, 1), model_file(ckpt, 1)):
        path.rename(path.with_name(path.name.replace("rank_1_", "rank_99999999999999_")))


def _missing_rank0(ckpt: Path) -> None:
    optim_file(ckpt, 0).unlink()
    model_file(ckpt, 0).unlink()


def _missing_model(ckpt: Path) -> None:
    model_file(ckpt, 1).unlink()


def _extra_rank(ckpt: Path) -> None:
    src = optim_file(ckpt, 1)
    shutil.copy(src, src.with_name(src.name.replace("rank_1", "rank_2")))
    shutil.copy(model_file(ckpt, 1), model_file(ckpt, 2))


def _truncated(ckpt: Path) -> None:
    path = optim_file(ckpt, 1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage(ckpt: Path) -> None:
    model_file(ckpt, 0).write_bytes(os.urandom(5000))


def _empty(ckpt: Path) -> None:
    optim_file(ckpt, 0).write_bytes(b"")


def _partition_count_high(ckpt: Path) -> None:
    edit(optim_file(ckpt, 0), lambda o: o["optimizer_state_dict"].__setitem__("partition_count", 4))


def _partition_count_low(ckpt: Path) -> None:
    for rank in (0, 1):
        edit(optim_file(ckpt, rank), lambda o: o["optimizer_state_dict"].__setitem__("partition_count", 1))


def _mixed_tags(ckpt: Path) -> None:
    edit(model_file(ckpt, 1), lambda o: o.__setitem__("global_steps", o["global_steps"] - 1))


def _mixed_versions(ckpt: Path) -> None:
    edit(model_file(ckpt, 1), lambda o: o.__setitem__("ds_version", "0.16.0"))


def _mixed_optim_version(ckpt: Path) -> None:
    edit(optim_file(ckpt, 1), lambda o: o.__setitem__("ds_version", "0.18.3"))


def _shapes_do_not_add_up(ckpt: Path) -> None:
    def grow(obj: Any) -> None:
        first = obj["param_shapes"][0]
        name = next(iter(first))
        first[name] = torch.Size([d + 1 for d in first[name]])

    for rank in (0, 1):
        edit(model_file(ckpt, rank), grow)


def _moment_too_short(ckpt: Path) -> None:
    def cut(obj: Any) -> None:
        state = obj["optimizer_state_dict"]["optimizer_state_dict"]["state"][0]
        state["exp_avg_sq"] = state["exp_avg_sq"][:-1].clone()

    edit(optim_file(ckpt, 1), cut)


def _unsupported_stage(ckpt: Path) -> None:
    for rank in (0, 1):
        edit(
            optim_file(ckpt, rank),
            lambda o: o["optimizer_state_dict"].__setitem__("zero_stage", standins.ZeroStageEnum(4)),
        )


def _stage_mismatch(ckpt: Path) -> None:
    edit(optim_file(ckpt, 1), lambda o: o["optimizer_state_dict"].__setitem__("zero_stage", standins.ZeroStageEnum(1)))


def _latest_points_outside(ckpt: Path) -> None:
    (ckpt / "latest").write_text("../../etc")


def _latest_binary(ckpt: Path) -> None:
    (ckpt / "latest").write_bytes(b"\xff\xfe\x00global")


def _hostile_rank_file(ckpt: Path) -> None:
    from test_torchfile import SystemCall

    torch.save({"optimizer_state_dict": SystemCall(ckpt / "ran")}, optim_file(ckpt, 1))


def _wrong_type(ckpt: Path) -> None:
    edit(optim_file(ckpt, 0), lambda o: o["optimizer_state_dict"].__setitem__("fp32_flat_groups", "oops"))


def _frozen_fragment_missing(ckpt: Path) -> None:
    edit(model_file(ckpt, 1), lambda o: o["frozen_param_fragments"].clear())


DAMAGE = {
    "missing rank file": (_missing_rank, ["rank_1_mp_rank_00_optim_states.pt is missing"]),
    "missing last rank": (_missing_last_rank, ["rank_1_mp_rank_00_optim_states.pt is missing", "partition_count=2"]),
    "absurd rank number": (_absurd_rank_number, ["rank_1_mp_rank_00_optim_states.pt", "missing"]),
    "missing rank 0": (_missing_rank0, ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "missing"]),
    "missing model file": (_missing_model, ["rank_1_mp_rank_00_model_states.pt is missing"]),
    "extra rank file": (_extra_rank, ["rank_2", "extra rank file", "partition_count=2"]),
    "truncated file": (_truncated, ["rank_1", "truncated"]),
    "corrupt file": (_garbage, ["rank_0", "not a torch checkpoint"]),
    "empty file": (_empty, ["is empty"]),
    "partition_count above the files": (_partition_count_high, ["partition_count=4", "missing"]),
    "partition_count below the files": (_partition_count_low, ["partition_count=1", "extra rank file"]),
    "mixed tags": (_mixed_tags, ["global_steps", "mixed"]),
    "mixed DeepSpeed versions": (_mixed_versions, ["different DeepSpeed versions", "0.16.0"]),
    "mixed DeepSpeed versions in optim files": (_mixed_optim_version, ["different DeepSpeed versions", "0.18.3"]),
    "partitions that do not add up": (_shapes_do_not_add_up, ["add up"]),
    "a moment shorter than its partition": (_moment_too_short, ["exp_avg_sq"]),
    "unsupported stage": (_unsupported_stage, ["zero_stage=4", "not supported"]),
    "stages mixed": (_stage_mismatch, ["zero_stage=1"]),
    "latest names a path": (_latest_points_outside, ["not a tag folder"]),
    "latest is binary": (_latest_binary, ["not a tag folder"]),
    "unsafe global": (_hostile_rank_file, ["posix.system", "allow-list"]),
    "wrong type": (_wrong_type, ["fp32_flat_groups is a str"]),
    "frozen fragment missing": (_frozen_fragment_missing, ["frozen"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoint_fails_with_one_line_and_no_output(
    z3_bf16_dp2: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    damage, needles = DAMAGE[case]
    ckpt = copy_checkpoint(z3_bf16_dp2, tmp_path / "ckpt")
    damage(ckpt)
    out = tmp_path / "out"
    code, err = run_cli(capsys, "to-universal", str(ckpt), str(out))
    assert_one_line_error(code, err, *needles)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "a staging folder was left behind"
    assert not (ckpt / "ran").exists()


@pytest.mark.slow
def test_universal_checksum_failure_is_one_line_with_exit_1(
    universal: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = tmp_path / "u"
    shutil.copytree(universal, damaged)
    manifest = json.loads((damaged / MANIFEST).read_text())
    entry = next(p for p in manifest["params"] if "exp_avg.pt" in p["files"])
    victim = damaged / "zero" / entry["folder"] / "exp_avg.pt"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x01  # a bit in the tensor bytes: still a loadable file, only the checksum can tell
    victim.write_bytes(bytes(data))
    out = tmp_path / "restored"
    code, err = run_cli(capsys, "restore", str(damaged), str(out), "--dp", "1")
    assert code == 1
    assert_one_line_error(code, err, "checksum", entry["folder"])
    assert not out.exists()


@pytest.mark.slow
def test_existing_output_is_untouched_without_overwrite(
    z3_bf16_dp2: Built, universal: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    shutil.copytree(universal, out)
    before = digests(out)
    code, err = run_cli(capsys, "to-universal", str(z3_bf16_dp2.path), str(out))
    assert_one_line_error(code, err, "already exists", "--overwrite")
    assert digests(out) == before


# -- the source is only ever read -------------------------------------------------------------
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_MUTATING_EVENTS = {
    "os.rename",
    "os.replace",
    "os.remove",
    "os.rmdir",
    "os.mkdir",
    "os.chmod",
    "os.chown",
    "os.utime",
    "os.truncate",
    "os.link",
    "os.symlink",
    "shutil.rmtree",
    "os.chflags",
}
_WATCH: dict[str, Any] = {"root": None, "hits": []}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    root = _WATCH["root"]
    if root is None:
        return
    if event == "mmap.__new__" and args[2] == mmap.ACCESS_WRITE:
        _WATCH["hits"].append((event, args))
        return
    if event != "open" and event not in _MUTATING_EVENTS:
        return
    target = args[0] if args else None
    if not isinstance(target, (str, bytes, os.PathLike)):
        return
    path = os.path.realpath(os.fsdecode(target))
    if not (path == root or path.startswith(root + os.sep)):
        return
    if event == "open":
        mode, flags = args[1], args[2] if len(args) > 2 else 0
        writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
        if not writes:
            return
    _WATCH["hits"].append((event, args))


@pytest.mark.slow
def test_source_is_opened_read_only_and_left_unchanged(
    z3_bf16_dp2: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = copy_checkpoint(z3_bf16_dp2, tmp_path / "ckpt")
    for folder, _dirs, files in os.walk(ckpt):
        for name in files:
            os.chmod(os.path.join(folder, name), 0o444)
    for folder, _dirs, _files in sorted(os.walk(ckpt), reverse=True):
        os.chmod(folder, 0o555)
    before = digests(ckpt)
    if not getattr(sys, "_ucp_audit_installed", False):
        sys.addaudithook(_audit)
        sys._ucp_audit_installed = True  # type: ignore[attr-defined]
    _WATCH.update(root=os.path.realpath(ckpt), hits=[])
    try:
        code, err = run_cli(capsys, "to-universal", str(ckpt), str(tmp_path / "out"), "--workers", "2")
    finally:
        _WATCH["root"] = None
        for folder, _dirs, _files in os.walk(ckpt):
            os.chmod(folder, 0o755)
    assert code == 0, err
    assert _WATCH["hits"] == [], f"the source was opened for writing or changed: {_WATCH['hits'][:3]}"
    assert digests(ckpt) == before
    assert assert_absent_or_whole(tmp_path / "out") == "whole"


# -- kill -9 at any moment --------------------------------------------------------------------
@pytest.fixture(scope="module")
def big_checkpoint() -> Built:
    """Large enough (about 25 MB of shards) that a conversion takes a visible while."""
    return build(
        dp=2, stage=3, dtype="bf16", optimizer="torch-adamw", model=ModelSpec(hidden=256, ffn=512, layers=8), steps=1
    )


def _count_dirs(folder: Path) -> int:
    try:
        return sum(1 for entry in os.scandir(folder) if entry.is_dir())
    except OSError:
        return 0


def _staging(out: Path) -> Path | None:
    for path in out.parent.glob(f".{out.name}{PARTIAL_MARK}*"):
        return path
    return None


def _convert_and_kill(
    src: Path, out: Path, when: str, delay: float, *, overwrite: bool, extra: tuple[str, ...] = ()
) -> str:
    """Start a conversion in a fresh interpreter and SIGKILL it at one moment; say how it ended.

    Moments: ``start`` (delay s after launch), ``staging`` (delay s after the staging folder
    appears), ``params`` (once ``delay`` parameter folders exist), ``state`` (the shared state file
    is being written), ``manifest`` (the staging folder holds its manifest: only fsync and rename
    are left), ``published`` (the new OUT is in place: the process is finishing up).
    """
    cmd = [sys.executable, "-m", "ucp", "to-universal", str(src), str(out), "--workers", "1"]
    if overwrite:
        cmd.append("--overwrite")
    cmd.extend(extra)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    old_marker = out / OLD_MARKER

    def published() -> bool:
        return (out / MANIFEST).exists() and not (overwrite and old_marker.exists())

    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    start = time.monotonic()
    seen: float | None = None
    try:
        while proc.poll() is None and time.monotonic() - start < 300:
            staging = _staging(out)
            if staging is not None and seen is None:
                seen = time.monotonic()
            if when == "start" and time.monotonic() - start >= delay:
                break
            if when == "staging" and seen is not None and time.monotonic() - seen >= delay:
                break
            if when == "params" and staging is not None and _count_dirs(staging / "zero") >= delay:
                break
            if when == "state" and staging is not None and (staging / "state.pt").exists():
                break
            if when == "manifest" and staging is not None and (staging / MANIFEST).exists():
                break
            if when == "published" and published():
                break
            time.sleep(0.001)
        state = "killed" if proc.poll() is None else f"exited {proc.returncode}"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    return state


OLD_MARKER = "marker-of-the-old-one"
# wall-clock moments, then moments tied to the run's progress (the conversion itself takes well
# under a second here, so only progress events land reliably inside it on a fast machine)
KILL_MOMENTS = [
    ("start", 0.2),
    ("start", 0.5),
    ("start", 1.0),
    ("staging", 0.0),
    ("staging", 0.05),
    ("staging", 0.2),
    ("params", 1),
    ("params", 12),
    ("params", 30),
    ("state", 0),
    ("manifest", 0),
    ("published", 0),
]


@pytest.mark.slow
def test_kill_9_at_any_moment_leaves_no_output_or_a_whole_one(
    big_checkpoint: Built, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = big_checkpoint.path
    before = digests(src)
    outcomes = []
    for i, (when, delay) in enumerate(KILL_MOMENTS):
        out = tmp_path / f"kill{i}" / "out"
        out.parent.mkdir()
        state = _convert_and_kill(src, out, when, delay, overwrite=False)
        outcomes.append((when, delay, state, assert_absent_or_whole(out)))
    # the moments really spread over the run: kills mid-way found no OUT, the last one a whole OUT
    # (a fast machine may finish the last steps between two polls, so not every one must land)
    mid_run = [o for o in outcomes if o[0] == "params" and o[2] == "killed"]
    assert len(mid_run) >= 2 and all(o[3] == "absent" for o in mid_run), outcomes
    assert outcomes[-1][3] == "whole", outcomes
    # a rerun clears what the killed run left and succeeds
    for i in range(len(KILL_MOMENTS)):
        out = tmp_path / f"kill{i}" / "out"
        if out.exists():
            continue
        code, err = run_cli(capsys, "to-universal", str(src), str(out), "--workers", "2")
        assert code == 0, err
        assert assert_absent_or_whole(out) == "whole"
        assert sorted(p.name for p in out.parent.iterdir()) == ["out"], "stale staging folder left"
    assert digests(src) == before


@pytest.mark.slow
@pytest.mark.parametrize("when,delay", [("staging", 0.2), ("manifest", 0.0), ("published", 0.0)])
def test_kill_9_during_overwrite_leaves_the_old_or_the_new_output_whole(
    big_checkpoint: Built, tmp_path: Path, when: str, delay: float
) -> None:
    out = tmp_path / "out"
    to_universal(big_checkpoint.path, out, workers=2)
    (out / OLD_MARKER).write_text("old")
    _convert_and_kill(big_checkpoint.path, out, when, delay, overwrite=True, extra=("--fsync",))
    # a kill can leave the swapped-out old folder under a partial name; the next run clears it
    assert assert_absent_or_whole(out) == "whole"
    to_universal(big_checkpoint.path, out, workers=2, overwrite=True)
    assert assert_absent_or_whole(out) == "whole"
    assert not (out / OLD_MARKER).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_the_package_never_unpickles_without_weights_only() -> None:
    """grep the package: no pickle.load(s), no torch.load without weights_only=True (the harness included)."""
    offenders = []
    for path in sorted((REPO / "ucp").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if "pickle.load" in code or "pickle.Unpickler(" in code or "weights_only=False" in code:
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
            if "torch.load(" in code and "weights_only=True" not in code:
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offenders == []
