"""ucp.io.atomic.staged_output: OUT is absent or whole, and an existing OUT is only ever replaced whole."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucp.errors import OutputExistsError
from ucp.io import atomic
from ucp.io.atomic import staged_output


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _tree(root: Path) -> dict[str, bytes]:
    """The files the caller wrote (the owner stamp every output gets is checked apart)."""
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != atomic.OWNER_MARK
    }


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


def _write_old(out: Path) -> None:
    out.mkdir(parents=True)
    (out / "old.txt").write_text("old")


def test_output_appears_whole_with_no_leftovers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with staged_output(out) as root:
        assert root.parent == out.parent and not out.exists()
        (root / "a").write_text("1")
        (root / "sub").mkdir()
        (root / "sub" / "b").write_text("2")
    assert _tree(out) == {"a": b"1", "sub/b": b"2"}
    assert _siblings(out) == []


def test_every_output_is_stamped_as_ucps_own_but_not_a_folder_staged_inside_another(tmp_path: Path) -> None:
    """The stamp is how a later --overwrite knows ucp wrote the folder (ucp.io.guard); an output built
    inside another one's staging folder (the HF target's native part) is part of that output."""
    out = tmp_path / "out"
    with staged_output(out) as root:
        with staged_output(root / "inner") as inner:
            (inner / "a").write_text("1")
    assert atomic.owner_kind(out) == "output"
    assert (out / "inner" / "a").read_text() == "1" and atomic.owner_kind(out / "inner") is None
    first = (out / atomic.OWNER_MARK).read_bytes()
    with staged_output(tmp_path / "again") as root:
        pass
    assert (tmp_path / "again" / atomic.OWNER_MARK).read_bytes() == first  # deterministic bytes


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not json",
        b'{"created_by": "someone", "kind": "output"}',
        b"[1]",
        b'{"created_by": "ucp 1"}' + b" " * 5000,
    ],
)
def test_a_stamp_that_is_not_ucps_does_not_count(tmp_path: Path, content: bytes) -> None:
    (tmp_path / atomic.OWNER_MARK).write_bytes(content)
    assert atomic.owner_kind(tmp_path) is None


def test_a_symlinked_stamp_does_not_count(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    atomic.mark_owned(tmp_path / "real")
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / atomic.OWNER_MARK).symlink_to(tmp_path / "real" / atomic.OWNER_MARK)
    assert atomic.owner_kind(tmp_path / "real") == "output" and atomic.owner_kind(tmp_path / "fake") is None


def test_error_inside_leaves_no_output_and_no_leftovers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with staged_output(out) as root:
            (root / "a").write_text("1")
            raise RuntimeError("boom")
    assert not out.exists() and _siblings(out) == []


def test_existing_output_is_untouched_without_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _write_old(out)
    mtime = (out / "old.txt").stat().st_mtime_ns
    with pytest.raises(OutputExistsError, match="--overwrite"):
        with staged_output(out):
            pytest.fail("must not get a staging folder")
    assert _tree(out) == {"old.txt": b"old"} and (out / "old.txt").stat().st_mtime_ns == mtime
    assert _siblings(out) == []


def test_dangling_symlink_counts_as_existing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.symlink_to(tmp_path / "nowhere")
    with pytest.raises(OutputExistsError):
        with staged_output(out):
            pass
    assert out.is_symlink()


def test_existing_file_is_never_replaced_even_with_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.write_text("a file")
    with pytest.raises(OutputExistsError, match="not a folder"):
        with staged_output(out, overwrite=True):
            pass
    assert out.read_text() == "a file"


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_overwrite_replaces_only_once_the_new_output_is_complete(
    tmp_path: Path, exchange: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not exchange:
        monkeypatch.setattr(atomic, "_renameat2", lambda *a: False)
    out = tmp_path / "out"
    _write_old(out)
    with staged_output(out, overwrite=True) as root:
        (root / "new.txt").write_text("new")
        assert _tree(out) == {"old.txt": b"old"}
    assert _tree(out) == {"new.txt": b"new"} and _siblings(out) == []


def test_overwrite_that_fails_keeps_the_old_output(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _write_old(out)
    with pytest.raises(RuntimeError):
        with staged_output(out, overwrite=True) as root:
            (root / "new.txt").write_text("new")
            raise RuntimeError("boom")
    assert _tree(out) == {"old.txt": b"old"} and _siblings(out) == []


def test_check_can_refuse_the_result(tmp_path: Path) -> None:
    out = tmp_path / "out"

    def check(root: Path) -> None:
        if not (root / "manifest").exists():
            raise ValueError("incomplete")

    with pytest.raises(ValueError):
        with staged_output(out, check=check) as root:
            (root / "data").write_text("x")
    assert not out.exists() and _siblings(out) == []


def test_second_rename_failing_puts_the_old_output_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomic, "_renameat2", lambda *a: False)
    out = tmp_path / "out"
    _write_old(out)
    real_rename = os.rename

    def flaky(src: str | os.PathLike, dst: str | os.PathLike) -> None:
        if Path(dst) == out and atomic.PARTIAL_MARK in Path(src).name:
            raise OSError(5, "I/O error")
        real_rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", flaky)
    with pytest.raises(OSError):
        with staged_output(out, overwrite=True) as root:
            (root / "new.txt").write_text("new")
    assert _tree(out) == {"old.txt": b"old"} and _siblings(out) == []


def test_partial_folders_of_dead_runs_are_cleared_and_live_ones_kept(tmp_path: Path) -> None:
    out = tmp_path / "out"
    dead, live = _dead_pid(), os.getppid()
    for name in (f".out.ucp-partial-{dead}", f".out.ucp-partial-0badf00d-{dead}", f".out.ucp-partial-old-{dead}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "junk").write_text("x")
    (tmp_path / f".out.ucp-partial-0badf00d-{live}").mkdir()
    (tmp_path / f".other.ucp-partial-{dead}").mkdir()  # another output's leftovers are not ours to clear
    with staged_output(out) as root:
        (root / "a").write_text("1")
    assert sorted(_siblings(out)) == sorted([f".out.ucp-partial-0badf00d-{live}", f".other.ucp-partial-{dead}"])


def test_output_name_with_glob_characters(tmp_path: Path) -> None:
    out = tmp_path / "run[1]*"
    dead = _dead_pid()
    (tmp_path / f".run[1]*.ucp-partial-{dead}").mkdir()
    with staged_output(out) as root:
        (root / "a").write_text("1")
    assert _tree(out) == {"a": b"1"} and _siblings(out) == []


def test_old_output_moved_aside_by_a_killed_overwrite_is_put_back(tmp_path: Path) -> None:
    """A kill between the two renames of the fallback path leaves OUT aside, whole; it comes back."""
    out = tmp_path / "out"
    dead = _dead_pid()
    aside = tmp_path / f".out{atomic.OLD_MARK}0badf00d-{dead}"
    _write_old(aside)
    (tmp_path / f".out{atomic.PARTIAL_MARK}0badf00d-{dead}").mkdir()  # the new one, never published
    with pytest.raises(OutputExistsError):
        with staged_output(out):
            pass
    assert _tree(out) == {"old.txt": b"old"} and _siblings(out) == []


def test_old_output_aside_is_dropped_once_a_new_output_exists(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "new.txt").write_text("new")
    _write_old(tmp_path / f".out{atomic.OLD_MARK}0badf00d-{_dead_pid()}")
    with staged_output(out, overwrite=True) as root:
        (root / "newer.txt").write_text("newer")
    assert _tree(out) == {"newer.txt": b"newer"} and _siblings(out) == []


def test_checksum_is_crc32_hex(tmp_path: Path) -> None:
    import zlib

    (tmp_path / "f").write_bytes(b"hello")
    (tmp_path / "e").write_bytes(b"")
    assert atomic.checksum(tmp_path / "f") == f"{zlib.crc32(b'hello'):08x}"
    assert atomic.checksum(tmp_path / "e") == "00000000"


def test_a_stop_already_raised_is_not_raised_again_by_its_re_delivery():
    """A stop noted inside importlib is delivered again 10 ms later; when raise_if_stopped raised it first, the
    re-delivery landed inside the clean-up's rmtree (CI: OSError, a descriptor closed twice, and a traceback)."""
    import signal
    import time

    from ucp.errors import Stopped
    from ucp.io import signals

    with signals.stop_on_signals():
        signals._RECEIVED.append(signal.SIGTERM)  # what the handler notes for a stop inside importlib's frames
        signals._DEFERRED.append(signal.SIGTERM)
        with pytest.raises(Stopped):
            signals.raise_if_stopped()
        os.kill(os.getpid(), signal.SIGTERM)  # the re-delivery: ignored, the command is already stopping
        time.sleep(0.05)


def test_a_signal_during_the_clean_up_removes_the_folder_whole_then_stops(tmp_path, monkeypatch):
    import shutil
    import signal

    from ucp.errors import Stopped
    from ucp.io import signals

    folder = tmp_path / "staging"
    (folder / "a" / "b").mkdir(parents=True)
    (folder / "a" / "b" / "f").write_bytes(b"x")
    real = shutil.rmtree

    def rmtree_with_a_signal(path, ignore_errors=False):
        os.kill(os.getpid(), signal.SIGTERM)
        real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", rmtree_with_a_signal)
    with signals.stop_on_signals(), pytest.raises(Stopped):
        atomic.remove_tree(folder)
    assert not folder.exists()


def test_a_stop_handled_by_one_command_is_not_raised_again_by_the_next_in_the_same_process(tmp_path):
    """In a notebook a Ctrl-C'd ``ucp.cli.main`` left its stop noted, and the next API call that publishes an output
    raised it again (and a test run in another order aborted the whole pytest session)."""
    import signal

    from ucp.errors import Stopped
    from ucp.io import signals

    with pytest.raises(Stopped), signals.stop_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between bytecodes
            pass
    try:
        signals.raise_if_stopped()
        with staged_output(tmp_path / "out") as stage:
            (stage / "f").write_text("x")
    except Stopped:  # a KeyboardInterrupt: uncaught it would end the whole session rather than fail the test
        pytest.fail("the earlier command's stop was raised again")
    assert (tmp_path / "out" / "f").read_text() == "x"
