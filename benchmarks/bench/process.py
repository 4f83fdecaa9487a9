"""Measuring one run of child processes: wall time, wait4 rusage, sampled process-tree RSS, timeouts.

This is the measuring instrument itself, kept apart from what is measured (measure.py) so that its
rules are in one place: each child in its own session, reaped with ``os.wait4`` (``Popen.wait`` drops
the rusage), killed as a whole tree on timeout or interruption.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from .common import REPO, BenchConfig, RunSpec
from .environment import tool_env

PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024

#: One process to start: its command line and its environment.
Job = tuple[list[str], dict[str, str]]


@dataclass
class Sample:
    """One timed subprocess run (or one multi-rank run, counted as one sample)."""

    tool: str
    round: int
    ok: bool
    wall_s: float
    maxrss_kib: int  # wait4 ru_maxrss; for ranks the max over ranks
    cpu_s: float = 0.0  # user+sys over every process started and the descendants each waited for
    rank_maxrss_kib: list[int] = field(default_factory=list)  # one per process started (ranks)
    tree_rss_peak_kib: int | None = None  # sampled sum of RSS over every process of the run
    loadavg_1m: float | None = None  # the machine's 1-minute load average as the run started
    returncode: int | None = None
    error: str | None = None
    log: str | None = None


def _session_rss_kib(sessions: set[int]) -> int:
    """Sum of RSS over every live process whose session id is one of ``sessions`` (one /proc scan)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
            fields = stat[stat.rindex(b")") + 2 :].split()  # state ppid pgrp session ...
            if int(fields[3]) not in sessions:
                continue
            with open(f"/proc/{entry.name}/statm", "rb") as fh:
                total += int(fh.read().split()[1]) * PAGE_KIB
        except (OSError, ValueError, IndexError):
            continue
    return total


class _TreeSampler(threading.Thread):
    """Polls the summed RSS of the children's sessions: wait4 alone cannot see concurrent workers."""

    def __init__(self, sessions: set[int], interval_s: float) -> None:
        super().__init__(daemon=True)
        self.sessions = sessions
        self.interval_s = interval_s
        self.peak_kib = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.peak_kib = max(self.peak_kib, _session_rss_kib(self.sessions))
            self.stop_event.wait(self.interval_s)


class _ProcessGroup:
    """The processes of one measured run, each in its own session so a timeout kills exactly their trees."""

    def __init__(self, timeout_s: float, sample_interval_s: float) -> None:
        self.sample_interval_s = sample_interval_s
        self.procs: list[subprocess.Popen] = []
        self.reaped: set[int] = set()
        self.lock = threading.Lock()
        self.timed_out = threading.Event()
        self.timer = threading.Timer(timeout_s, self.kill_unreaped)
        self.sampler: _TreeSampler | None = None
        self.rss: list[int] = []
        self.cpu: list[float] = []
        self.codes: list[int] = []

    def kill_unreaped(self) -> None:
        """SIGKILL the session (process group) of every child not reaped yet, worker pools included."""
        with self.lock:
            self.timed_out.set()
            for proc in self.procs:
                if proc.pid not in self.reaped:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

    def start(self, jobs: list[Job], handles: Sequence[IO[bytes]]) -> None:
        """Start every job with its output to its log, then the timeout timer and the RSS sampler."""
        for (cmd, env), handle in zip(jobs, handles):
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    cwd=REPO,
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        self.timer.start()
        if self.sample_interval_s > 0:
            self.sampler = _TreeSampler({p.pid for p in self.procs}, self.sample_interval_s)
            self.sampler.start()

    def reap(self) -> None:
        """wait4 each child in turn, keeping its peak RSS, CPU time and exit code."""
        for proc in self.procs:
            _, status, usage = os.wait4(proc.pid, 0)
            with self.lock:
                self.reaped.add(proc.pid)
            proc.returncode = os.waitstatus_to_exitcode(status)  # so Popen does not try to reap it again
            self.rss.append(usage.ru_maxrss)
            self.cpu.append(usage.ru_utime + usage.ru_stime)
            self.codes.append(proc.returncode)

    def close(self) -> None:
        """Stop the timer and the sampler; when interrupted, leave nothing of ours behind."""
        self.timer.cancel()
        if self.sampler is not None:
            self.sampler.stop_event.set()
            self.sampler.join()
        if len(self.codes) < len(self.procs):
            self.kill_unreaped()
            for proc in self.procs:
                if proc.pid not in self.reaped:
                    proc.wait()


def _tail(path: Path, limit: int = 2500) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def run_measured(tool: str, round_: int, jobs: list[Job], logs: list[Path], cfg: BenchConfig) -> Sample:
    """Start ``jobs`` (one process each, in its own session), reap each with wait4, time the whole run.

    Every process gets its own session so that a timeout can kill exactly the trees this function
    started (killpg by the child's id), worker pools included.
    """
    for log in logs:
        log.parent.mkdir(parents=True, exist_ok=True)
    handles = [open(log, "wb") for log in logs]
    group = _ProcessGroup(cfg.timeout_s, cfg.sample_interval_s)
    load = os.getloadavg()[0]
    start = time.perf_counter()
    try:
        group.start(jobs, handles)
        group.reap()
        wall = time.perf_counter() - start
    finally:
        group.close()
        for handle in handles:
            handle.close()
    sample = _to_sample(tool, round_, group, wall, logs, cfg.timeout_s)
    sample.loadavg_1m = load
    return sample


def _to_sample(tool: str, round_: int, group: _ProcessGroup, wall: float, logs: list[Path], timeout_s: float) -> Sample:
    """The finished group as a Sample; a failure names the first failed process and the tail of its log."""
    codes, rss = group.codes, group.rss
    failed = [i for i, code in enumerate(codes) if code != 0]
    error = None
    if failed:
        first = failed[0]
        why = f"timed out after {timeout_s:.0f} s" if group.timed_out.is_set() else f"exit code {codes[first]}"
        tail = _tail(logs[first])
        last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "(empty log)")
        error = f"{why}: {last} [log: {logs[first]}]\n{tail}"
    return Sample(
        tool=tool,
        round=round_,
        ok=not failed,
        wall_s=wall,
        maxrss_kib=max(rss),
        cpu_s=sum(group.cpu),
        rank_maxrss_kib=rss,
        tree_rss_peak_kib=group.sampler.peak_kib if group.sampler is not None else None,
        returncode=codes[failed[0]] if failed else 0,
        error=error,
        log=str(logs[0]),
    )


def free_port() -> int:
    """A free local port for torch.distributed (as ucp.harness.launch.free_port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_jobs(spec: RunSpec) -> list[Job]:
    """The harness worker command and environment per rank, as ucp.harness.run_ranks builds them.

    Re-built here (not via run_ranks) because run_ranks reaps with Popen.wait, which drops the rusage.
    """
    spec.port = spec.port or free_port()
    jobs = []
    for rank in range(spec.dp):
        env = tool_env()
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(spec.dp),
            LOCAL_WORLD_SIZE=str(spec.dp),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(spec.port),
            OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
            PYTHONWARNINGS="ignore",
        )
        jobs.append(([sys.executable, "-m", "ucp.harness.worker", spec.to_json()], env))
    return jobs
