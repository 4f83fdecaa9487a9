"""A warm parent for CPU harness ranks: torch and DeepSpeed imported once, every rank forked from it.

A rank started with ``python -m`` spends about 6 s of CPU importing torch, its compiler stack (DeepSpeed's
Muon module pulls in torch._dynamo) and DeepSpeed before any work, while a test rank's work is well under a
second; forked from a process that holds them, it starts at once. :func:`ucp.harness.launch.launch` uses it
when ``UCP_HARNESS_FORK=1`` (the test suite sets it) for CPU runs only: nothing here initialises CUDA, and a
CUDA run is always started fresh.

The zygote reads one JSON request per line on stdin (module, argv, env, cwd, log, exit file), forks, and
answers the child's pid on its own line. The child takes the request's environment and working folder, sends
stdout and stderr to the log, runs the module as ``__main__``, and writes its exit code to the exit file
(``end_rank`` writes it too, as it leaves through ``os._exit``). Exited children are reaped by the kernel
(SIGCHLD ignored), so the launcher watches their pids.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

__all__ = ["EXIT_FILE_ENV", "PRELOAD", "ForkedRank", "Zygote", "serve", "write_exit_code", "zygote_for"]

#: what the zygote imports before it forks (absent ones are skipped); nothing that reads the rank's
#: environment at import time (transformers and huggingface_hub read HF_HUB_OFFLINE then)
PRELOAD = (
    "torch",
    "torch.distributed",
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "deepspeed.runtime.pipe",
    "ucp.harness.worker",
    "ucp.harness.pipeline",
    "ucp.harness.moe",
    "ucp.harness.fsdp",
)
#: the variable naming the file a forked rank writes its exit code to
EXIT_FILE_ENV = "UCP_RANK_EXIT_FILE"


def write_exit_code(code: int) -> None:
    """Record a forked rank's exit code where its launcher looks (no-op for a rank started fresh)."""
    path = os.environ.get(EXIT_FILE_ENV)
    if path:
        with open(path, "w") as handle:
            handle.write(str(code))


def _exit_code(error: SystemExit) -> int:
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def _child(request: dict[str, Any], answers: TextIO) -> None:
    """Become the rank ``request`` asks for; never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the rank's own subprocesses (ninja) are waited for
        answers.close()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:0] = [request["cwd"], *extra]
        import torch

        torch.set_num_threads(int(request["env"].get("OMP_NUM_THREADS", "1")))
        sys.argv = [request["module"], *request["argv"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as error:
        code = _exit_code(error)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            write_exit_code(code)
        finally:
            os._exit(code)


def serve(preload: tuple[str, ...] = PRELOAD) -> None:
    """Import ``preload``, then fork a rank for every request on stdin until it closes."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the imports print goes to stderr, not into the answers
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional module: the rank imports it itself if it needs it
            pass
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, answers)
        answers.write(f"{pid}\n")
        answers.flush()


class ForkedRank:
    """A rank the zygote forked, watched through its pid and exit file (it is the zygote's child, not ours)."""

    def __init__(self, pid: int, exit_file: Path) -> None:
        self.pid = pid
        self.exit_file = exit_file

    def poll(self) -> int | None:
        """None while it runs; then its exit code, or -1 when it left none (killed, or crashed in C)."""
        try:
            os.kill(self.pid, 0)
            return None
        except ProcessLookupError:
            try:
                return int(self.exit_file.read_text())
            except (OSError, ValueError):
                return -1

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        while (code := self.poll()) is None:
            time.sleep(0.02)
        return code


class Zygote:
    """The client side: one warm zygote process, started with the environment its ranks share."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.key = import_time(env)
        self.exits = Path(tempfile.mkdtemp(prefix="ucp-zygote-"))  # the ranks' exit files, beside no log
        self.started = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ucp.harness.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=dict(env),
            text=True,
        )
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self, module: str, argv: list[str], env: Mapping[str, str], cwd: str, log: Path) -> ForkedRank:
        """Start ``python -m module *argv`` as a forked rank with ``env`` in ``cwd``, its output in ``log``."""
        self.started += 1
        exit_file = self.exits / f"{self.started}.exit"
        request = {
            "module": module,
            "argv": argv,
            "env": {**env, EXIT_FILE_ENV: str(exit_file)},
            "cwd": cwd,
            "log": str(log),
        }
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError("the harness zygote exited (its imports failed?)")
        return ForkedRank(int(answer), exit_file)

    def close(self) -> None:
        shutil.rmtree(self.exits, ignore_errors=True)
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


#: the variable that turns forking on (the test suite sets it), and the zygote of this process
FORK_ENV = "UCP_HARNESS_FORK"
_ZYGOTE: Zygote | None = None
#: variables torch, DeepSpeed, the OpenMP runtime, Python or Hugging Face may read as they are imported: a
#: rank forked from a zygote started with other values would not see its own
_IMPORT_TIME = ("DS_", "TORCH", "CUDA", "OMP_", "MKL_", "KMP_", "HF_", "TRANSFORMERS", "TOKENIZERS", "LD_", "PYTHONW")


def import_time(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` a zygote must share with the ranks it forks."""
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME)}


def zygote_for(env: Mapping[str, str]) -> Zygote | None:
    """The zygote to fork a rank with ``env`` from, or None to start it fresh: forking is on, the run is on
    the CPU, and ``env`` agrees with the zygote's in what imports read (another zygote replaces it if not)."""
    global _ZYGOTE
    if os.environ.get(FORK_ENV) != "1" or env.get("DS_ACCELERATOR") != "cpu":
        return None
    if _ZYGOTE is None or not _ZYGOTE.alive() or _ZYGOTE.key != import_time(env):
        if _ZYGOTE is not None:
            _ZYGOTE.close()
        _ZYGOTE = Zygote(env)
    return _ZYGOTE


if __name__ == "__main__":
    serve()
