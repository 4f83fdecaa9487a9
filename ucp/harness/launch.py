"""Start N local ranks of a harness module (the DeepSpeed worker, or the FSDP2 one) with the
environment torch.distributed expects."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from ucp.harness.ops import check_op_build
from ucp.harness.spec import RunSpec
from ucp.harness.zygote import ForkedRank, write_exit_code, zygote_for

__all__ = ["NO_RANKS", "RankFailure", "WORKER", "end_rank", "free_port", "launch", "run_ranks"]


class RankFailure(RuntimeError):
    """A rank exited non-zero; the message carries the tail of its log."""


def end_rank() -> None:
    """Leave a finished rank at once, after every rank reached this point (call it last).

    A process that returns normally runs C++ destructors of threads that gloo and DeepSpeed's
    shared-memory comm op leave behind, and one of them now and then aborts the process
    ("terminate called without an active exception") after all its work is written. The barrier
    keeps a rank from leaving while another still talks to it; ``os._exit`` skips the destructors.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    write_exit_code(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


#: set (to anything) to refuse every launch: how the test suite's fast tier proves it trains nothing
NO_RANKS = "UCP_NO_RANKS"
#: the module each rank runs unless told otherwise: one DeepSpeed rank (``python -m MODULE SPEC_JSON``)
WORKER = "ucp.harness.worker"


def run_ranks(
    spec: RunSpec,
    *,
    timeout: float = 900.0,
    log_dir: str | os.PathLike | None = None,
    module: str = WORKER,
) -> None:
    """Run ``python -m module SPEC_JSON`` on ``spec.dp x spec.tp`` local processes and wait for all of them
    (see :func:`launch`). DeepSpeed ranks on CPU first have their C++ op's build checked (a compiler, no stale
    lock): one line instead of a hang or a traceback per rank."""
    if module == WORKER and getattr(spec, "device", "cpu") == "cpu":
        check_op_build()
    if not spec.port:
        spec.port = free_port()
    env = {"DS_ACCELERATOR": getattr(spec, "device", "cpu")}  # a run on GPUs says so in its spec
    launch(spec.dp * spec.tp, spec.to_json(), port=spec.port, module=module, timeout=timeout, log_dir=log_dir, env=env)


def launch(
    world: int,
    payload: str,
    *,
    port: int,
    module: str,
    timeout: float = 900.0,
    log_dir: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
) -> Path:
    """Run ``python -m module PAYLOAD`` on ``world`` local processes and wait for all of them.

    Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (plus ``env``); DeepSpeed
    runs on its CPU accelerator, every run on gloo. Returns the log folder. Raises RankFailure naming
    the first rank that failed (and the module, so a log says which harness it came from). With ``UCP_NO_RANKS``
    set (the test suite's fast tier) nothing is started: a RuntimeError says so.
    """
    if os.environ.get(NO_RANKS):
        raise RuntimeError(f"{NO_RANKS} is set (the fast test tier): {module} would start {world} ranks")
    logs = Path(log_dir or tempfile.mkdtemp(prefix="ucp-ranks-"))
    logs.mkdir(parents=True, exist_ok=True)
    for attempt in range(_PORT_ATTEMPTS):
        failed = _run_once(world, payload, port=port, module=module, timeout=timeout, logs=logs, env=env, cwd=cwd)
        if not failed:
            return logs
        rank, code = failed[0]
        tail = (logs / f"rank{rank}.log").read_text(errors="replace")[-4000:]
        if "EADDRINUSE" in tail and attempt + 1 < _PORT_ATTEMPTS:
            port = free_port()  # another process took the free port between free_port() and rank 0's bind
            continue
        raise RankFailure(f"{module} rank {rank} exited with {code} (logs in {logs}):\n{tail}")
    raise AssertionError("unreachable")


#: launches tried when rank 0 finds MASTER_PORT taken
_PORT_ATTEMPTS = 3
#: seconds the other ranks get to exit on their own once one has failed (they would wait for it until
#: gloo's timeout), before they are killed
_GRACE = 10.0


def _run_once(
    world: int,
    payload: str,
    *,
    port: int,
    module: str,
    timeout: float,
    logs: Path,
    env: Mapping[str, str] | None,
    cwd: str | os.PathLike | None,
) -> list[tuple[int, int | str]]:
    """Start every rank, wait for all; the ranks that failed, in rank order ((rank, exit code or why))."""
    procs: list[tuple[subprocess.Popen | ForkedRank, IO | None]] = []
    for rank in range(world):
        rank_env = dict(os.environ)
        rank_env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            DS_ACCELERATOR="cpu",
            OMP_NUM_THREADS=rank_env.get("OMP_NUM_THREADS", "1"),
            PYTHONWARNINGS="ignore",
        )
        rank_env.update(env or {})
        zygote = zygote_for(rank_env)
        if zygote is not None:  # forked from a process that has imported torch and DeepSpeed already
            forked = zygote.fork(module, [payload], rank_env, str(cwd or os.getcwd()), logs / f"rank{rank}.log")
            procs.append((forked, None))
            continue
        log = open(logs / f"rank{rank}.log", "w")
        cmd = [sys.executable, "-m", module, payload]
        procs.append((subprocess.Popen(cmd, env=rank_env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT), log))
    codes: dict[int, int | str] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(codes) < world:
            for rank, (proc, _) in enumerate(procs):
                if rank not in codes and (code := proc.poll()) is not None:
                    codes[rank] = code
            if any(code != 0 for code in codes.values()):
                deadline = min(deadline, time.monotonic() + _GRACE)
            if time.monotonic() > deadline:
                why = "timeout" if all(code == 0 for code in codes.values()) else "killed: another rank failed"
                codes.update({rank: why for rank in range(world) if rank not in codes})
                break
            time.sleep(0.05)
    finally:
        for proc, handle in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            if handle is not None:
                handle.close()
    first = [(rank, code) for rank, code in sorted(codes.items()) if isinstance(code, int) and code != 0]
    return first + [(rank, code) for rank, code in sorted(codes.items()) if isinstance(code, str)]
