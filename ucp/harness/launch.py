"""Start N local ranks of a harness module (the DeepSpeed worker, or the FSDP2 one) with the
environment torch.distributed expects."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

from ucp.harness.spec import RunSpec

__all__ = ["RankFailure", "WORKER", "end_rank", "free_port", "launch", "run_ranks"]


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
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    (see :func:`launch`)."""
    if not spec.port:
        spec.port = free_port()
    launch(spec.dp * spec.tp, spec.to_json(), port=spec.port, module=module, timeout=timeout, log_dir=log_dir)


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
    the first rank that failed (and the module, so a log says which harness it came from).
    """
    logs = Path(log_dir or tempfile.mkdtemp(prefix="ucp-ranks-"))
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
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
        log = open(logs / f"rank{rank}.log", "w")
        cmd = [sys.executable, "-m", module, payload]
        procs.append((rank, subprocess.Popen(cmd, env=rank_env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT), log))
    failed = []
    try:
        for rank, proc, log in procs:
            code: int | str
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = "timeout"
            log.close()
            if code != 0:
                failed.append((rank, code))
    finally:
        for _, proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failed:
        rank, code = failed[0]
        tail = (logs / f"rank{rank}.log").read_text(errors="replace")[-4000:]
        raise RankFailure(f"{module} rank {rank} exited with {code} (logs in {logs}):\n{tail}")
    return logs
