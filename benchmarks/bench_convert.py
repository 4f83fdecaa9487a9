#!/usr/bin/env python
"""Benchmark ``ucp to-universal`` / ``ucp restore`` against DeepSpeed's own universal-checkpoint path.

One command builds (or reuses) a real ZeRO-3 bf16 checkpoint at DP=4 through ``ucp.harness`` and then,
round by round with the order rotated, runs every tool as its own subprocess:

* ``python -m ucp to-universal SRC OUT``                              (ucp conversion)
* ``python -m deepspeed.checkpoint.ds_to_universal ...``              (DeepSpeed conversion)
* ``cp -r TAG_DIR OUT``                                               (the floor: copying the bytes once)
* ``python -m ucp restore UNIV OUT --dp N`` + a DP=N engine loading that native checkpoint
* a DP=4 engine with ``checkpoint.load_universal`` loading DeepSpeed's universal directory
* a DP=4 engine that loads nothing (engine start-up, subtracted from both load paths)
* ``python -c "import torch"`` / ``python -c "import deepspeed"``     (bare import cost)

Wall time is ``time.perf_counter`` around each subprocess; peak memory is the child's ``ru_maxrss`` from
``os.wait4`` (the largest single process of the child's tree, because Linux folds in the waited-for
descendants' maximum, not their sum) plus, by default, a sampled sum of RSS over the whole process tree
(catches ``ds_to_universal``'s worker pool; counts shared pages once per process, so an upper bound).

Results go to ``benchmarks/out/results-<size>mb.{json,md}``; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Callable

REPO = Path(__file__).resolve().parents[1]


def _load_harness_spec() -> ModuleType:
    """ucp/harness/spec.py on its own, without importing the ``ucp`` package.

    Importing ``ucp`` imports torch (~225 MiB). A child started with fork/vfork inherits its parent's
    peak RSS into its own ru_maxrss (Linux keeps the old mm's high-water mark across exec), so a heavy
    parent would put a floor under every number measured here. spec.py needs only json and dataclasses.
    """
    name = "_bench_harness_spec"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "ucp" / "harness" / "spec.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[name]


_spec = _load_harness_spec()
LoadSpec, ModelSpec, RunSpec = _spec.LoadSpec, _spec.ModelSpec, _spec.RunSpec

logger = logging.getLogger("bench_convert")

MB = 1_000_000  # sizes are decimal megabytes, as `ls -l` bytes / 1e6
BYTES_PER_PARAM = 12  # ZeRO-3 bf16 optimizer shards: fp32 master + exp_avg + exp_avg_sq
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024

#: Ratio targets for docs/performance.md: (name, numerator, denominator, target, checked, meaning).
#: The CPU-time rows are not what the targets are defined on, but they survive a busy machine far better
#: than wall time does (user+sys of the child and every descendant it waited for, from wait4).
TARGETS = (
    ("time", "ucp-to-universal", "ds-to-universal", 0.25, True, "whole-process wall time, ucp / ds_to_universal"),
    ("work", "ucp-work", "ds-work", 0.10, True, "wall minus bare import of the heavy library, ucp / ds_to_universal"),
    ("rss", "ucp-rss", "ds-rss", 0.50, True, "peak RSS (wait4 ru_maxrss), ucp / ds_to_universal"),
    ("vs-cp", "ucp-work", "cp", 3.0, True, "ucp work / `cp -r` of the shard folder"),
    ("cpu-time", "ucp-cpu", "ds-cpu", 0.25, False, "CPU time (user+sys, whole tree), ucp / ds_to_universal"),
    ("cpu-work", "ucp-cpu-work", "ds-cpu-work", 0.10, False, "CPU time minus the bare import's, ucp / ds"),
)


# --------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class BenchConfig:
    """Everything a run depends on; parsed once from the command line and passed down."""

    sizes_mb: tuple[int, ...]
    rounds: int
    dp: int
    restore_dp: int
    hidden: int
    ffn: int
    vocab: int
    steps: int
    ds_workers: int
    import_reps: int
    out_dir: Path
    timeout_s: float
    sample_interval_s: float
    ucp_src: str  # "tag": the folder holding the shard files; "root": the folder holding `latest`
    skip_loads: bool
    ds_temp_probe: bool
    rebuild: bool
    keep_outputs: bool
    plot: bool
    check: bool


@dataclass
class Checkpoint:
    """A cached harness checkpoint and what it holds."""

    size_mb: int
    root: Path  # holds `latest`
    tag: str
    model: ModelSpec
    params_trainable: int
    bytes_on_disk: int
    build_s: float | None

    @property
    def tag_dir(self) -> Path:
        return self.root / self.tag


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
    returncode: int | None = None
    error: str | None = None
    log: str | None = None


# --------------------------------------------------------------------------------------------- sizing


def trainable_params(model: ModelSpec) -> int:
    """Parameters the optimizer holds for the harness TinyLM (the frozen projection holds no state)."""
    embed = model.vocab * model.hidden  # the head is tied to it
    head = 0 if model.tied else model.vocab * model.hidden
    block = 2 * model.hidden * model.ffn + model.ffn + model.hidden
    norm = 2 * model.hidden
    return embed + head + model.layers * block + norm


def model_for_size(size_mb: int, hidden: int, ffn: int, vocab: int) -> ModelSpec:
    """Grow the model with ``layers`` only, so the largest parameter is the same at every size."""
    base = ModelSpec(vocab=vocab, hidden=hidden, ffn=ffn, layers=0)
    per_layer = 2 * hidden * ffn + ffn + hidden
    target = size_mb * MB / BYTES_PER_PARAM - trainable_params(base)
    base.layers = max(1, round(target / per_layer))
    return base


def _dir_bytes(path: Path) -> tuple[int, int]:
    """(apparent bytes, file count) under ``path``; 0 when it does not exist."""
    total = files = 0
    if not path.exists():
        return 0, 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
                files += 1
            except OSError:
                pass
    return total, files


# --------------------------------------------------------------------------------------------- build


def build_checkpoint(cfg: BenchConfig, size_mb: int) -> Checkpoint:
    """Train ``steps`` steps at DP=cfg.dp with real DeepSpeed and save; reuse a finished earlier build.

    The marker ``build.json`` is written last, so a half-built folder is never taken for a cache hit.
    """
    model = model_for_size(size_mb, cfg.hidden, cfg.ffn, cfg.vocab)
    key = f"ckpt-{size_mb}mb-dp{cfg.dp}-v{cfg.vocab}-h{cfg.hidden}-f{cfg.ffn}-l{model.layers}-s{cfg.steps}"
    home = cfg.out_dir / "ckpt" / key
    marker = home / "build.json"
    if marker.is_file() and not cfg.rebuild:
        meta = json.loads(marker.read_text())
        logger.info("reusing checkpoint %s (%.0f MB)", home, meta["bytes_on_disk"] / MB)
        return Checkpoint(size_mb, home / "ckpt", meta["tag"], model, meta["params_trainable"],
                          meta["bytes_on_disk"], meta.get("build_s"))
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    spec = RunSpec(dp=cfg.dp, stage=3, dtype="bf16", model=model, global_batch=_global_batch(cfg), seq=8,
                   steps=cfg.steps, save_dir=str(home / "ckpt"))
    logger.info("building %d MB checkpoint: DP=%d, %d layers (hidden=%d ffn=%d vocab=%d), %.1f M params",
                size_mb, cfg.dp, model.layers, cfg.hidden, cfg.ffn, cfg.vocab, trainable_params(model) / 1e6)
    # ucp.harness.run_ranks, in a child so that this process never imports torch (see _load_harness_spec)
    build = [sys.executable, "-c", "import sys; from ucp.harness import RunSpec, run_ranks; "
             "run_ranks(RunSpec.from_json(sys.argv[1]), timeout=float(sys.argv[2]), log_dir=sys.argv[3])",
             spec.to_json(), str(cfg.timeout_s), str(home / "build-logs")]
    start = time.perf_counter()
    done = subprocess.run(build, env=tool_env(), cwd=REPO, capture_output=True, text=True, check=False)
    build_s = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"building the {size_mb} MB checkpoint failed:\n{done.stderr[-4000:]}")
    root = home / "ckpt"
    tag = (root / "latest").read_text().strip()
    nbytes, _ = _dir_bytes(root / tag)
    meta = {"tag": tag, "params_trainable": trainable_params(model), "bytes_on_disk": nbytes,
            "build_s": build_s, "model": asdict(model), "dp": cfg.dp, "steps": cfg.steps}
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.rename(marker)
    logger.info("built %s in %.0f s (%.0f MB on disk)", root / tag, build_s, nbytes / MB)
    return Checkpoint(size_mb, root, tag, model, meta["params_trainable"], nbytes, build_s)


def _global_batch(cfg: BenchConfig) -> int:
    """The smallest batch both DP sizes divide (the harness slices one global batch per rank)."""
    return math.lcm(cfg.dp, cfg.restore_dp)


# --------------------------------------------------------------------------------------------- running


def _session_rss_kib(sessions: set[int]) -> int:
    """Sum of RSS over every live process whose session id is one of ``sessions`` (one /proc scan)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as fh:
                stat = fh.read()
            fields = stat[stat.rindex(b")") + 2:].split()  # state ppid pgrp session ...
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


def _tail(path: Path, limit: int = 2500) -> str:
    try:
        return path.read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def run_measured(tool: str, round_: int, jobs: list[tuple[list[str], dict[str, str]]], logs: list[Path],
                 cfg: BenchConfig) -> Sample:
    """Start ``jobs`` (one process each, in its own session), reap each with wait4, time the whole run.

    Every process gets its own session so that a timeout can kill exactly the trees this function
    started (killpg by the child's id), worker pools included.
    """
    for log in logs:
        log.parent.mkdir(parents=True, exist_ok=True)
    handles = [open(log, "wb") for log in logs]
    procs: list[subprocess.Popen] = []
    reaped: set[int] = set()
    lock = threading.Lock()
    timed_out = threading.Event()

    def kill_unreaped() -> None:
        with lock:
            timed_out.set()
            for proc in procs:
                if proc.pid not in reaped:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

    timer = threading.Timer(cfg.timeout_s, kill_unreaped)
    sampler: _TreeSampler | None = None
    rss: list[int] = []
    cpu: list[float] = []
    codes: list[int] = []
    start = time.perf_counter()
    try:
        for (cmd, env), handle in zip(jobs, handles):
            procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True))
        timer.start()
        if cfg.sample_interval_s > 0:
            sampler = _TreeSampler({p.pid for p in procs}, cfg.sample_interval_s)
            sampler.start()
        for proc in procs:
            _, status, usage = os.wait4(proc.pid, 0)
            with lock:
                reaped.add(proc.pid)
            proc.returncode = os.waitstatus_to_exitcode(status)  # so Popen does not try to reap it again
            rss.append(usage.ru_maxrss)
            cpu.append(usage.ru_utime + usage.ru_stime)
            codes.append(proc.returncode)
        wall = time.perf_counter() - start
    finally:
        timer.cancel()
        if sampler is not None:
            sampler.stop_event.set()
            sampler.join()
        if len(codes) < len(procs):  # interrupted: leave nothing of ours behind
            kill_unreaped()
            for proc in procs:
                if proc.pid not in reaped:
                    proc.wait()
        for handle in handles:
            handle.close()
    failed = [i for i, code in enumerate(codes) if code != 0]
    error = None
    if failed:
        first = failed[0]
        why = f"timed out after {cfg.timeout_s:.0f} s" if timed_out.is_set() else f"exit code {codes[first]}"
        tail = _tail(logs[first])
        last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "(empty log)")
        error = f"{why}: {last} [log: {logs[first]}]\n{tail}"
    return Sample(tool=tool, round=round_, ok=not failed, wall_s=wall, maxrss_kib=max(rss), cpu_s=sum(cpu),
                  rank_maxrss_kib=rss,
                  tree_rss_peak_kib=sampler.peak_kib if sampler is not None else None,
                  returncode=codes[failed[0]] if failed else 0, error=error, log=str(logs[0]))


def tool_env() -> dict[str, str]:
    """The same environment for every measured child: CPU accelerator, this checkout first on the path."""
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def free_port() -> int:
    """A free local port for torch.distributed (as ucp.harness.launch.free_port)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_jobs(spec: RunSpec) -> list[tuple[list[str], dict[str, str]]]:
    """The harness worker command and environment per rank, as ucp.harness.run_ranks builds them.

    Re-built here (not via run_ranks) because run_ranks reaps with Popen.wait, which drops the rusage.
    """
    spec.port = spec.port or free_port()
    jobs = []
    for rank in range(spec.dp):
        env = tool_env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(spec.dp), LOCAL_WORLD_SIZE=str(spec.dp),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec.port),
                   OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore")
        jobs.append(([sys.executable, "-m", "ucp.harness.worker", spec.to_json()], env))
    return jobs


def _remove(path: Path) -> None:
    """Delete an output and flush dirty pages, outside any timing, so the next tool starts clean."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
    os.sync()


def _native_load_target(out: Path) -> tuple[Path, str | None]:
    """Where DeepSpeed should load ucp's native output from: (load_dir, tag), tolerant of the layout."""
    if (out / "latest").is_file():
        return out, None
    if any(out.glob("*model_states.pt")):
        return out.parent, out.name
    tags = [d for d in out.iterdir() if d.is_dir() and any(d.glob("*model_states.pt"))] if out.is_dir() else []
    if len(tags) == 1:
        return out, tags[0].name
    raise FileNotFoundError(f"no `latest` and no single tag folder with *model_states.pt under {out}")


# --------------------------------------------------------------------------------------------- one size


@dataclass
class SizeRun:
    """State of one size's measurement: where things go and what was measured so far."""

    cfg: BenchConfig
    ckpt: Checkpoint
    work: Path
    logs: Path
    samples: list[Sample] = field(default_factory=list)
    disk: dict[str, dict[str, int]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def record(self, sample: Sample) -> Sample:
        self.samples.append(sample)
        rss = sample.maxrss_kib / 1024
        tree = f", tree {sample.tree_rss_peak_kib / 1024:.0f} MiB" if sample.tree_rss_peak_kib else ""
        if sample.ok:
            logger.info("  r%d %-22s %8.2f s  peak %6.0f MiB%s", sample.round, sample.tool, sample.wall_s, rss, tree)
        else:
            logger.warning("  r%d %-22s FAILED after %.2f s: %s", sample.round, sample.tool, sample.wall_s,
                           (sample.error or "").splitlines()[0])
        return sample

    def run(self, tool: str, round_: int, cmd: list[str]) -> Sample:
        return self.record(run_measured(tool, round_, [(cmd, tool_env())],
                                        [self.logs / f"r{round_}-{tool}.log"], self.cfg))

    def run_engine(self, tool: str, round_: int, dp: int, load: LoadSpec | None) -> Sample:
        spec = RunSpec(dp=dp, stage=3, dtype="bf16", model=self.ckpt.model, global_batch=_global_batch(self.cfg),
                       seq=8, steps=0, load=load)
        logs = [self.logs / f"r{round_}-{tool}-rank{r}.log" for r in range(dp)]
        return self.record(run_measured(tool, round_, rank_jobs(spec), logs, self.cfg))

    def note_disk(self, name: str, path: Path) -> None:
        if name not in self.disk:
            nbytes, files = _dir_bytes(path)
            self.disk[name] = {"bytes": nbytes, "files": files}

    # Each unit is independent of the others' order; units that produce outputs delete them at the end.

    def unit_imports(self, r: int) -> None:
        for _ in range(self.cfg.import_reps):
            self.run("import-torch", r, [sys.executable, "-c", "import torch"])
            self.run("import-deepspeed", r, [sys.executable, "-c", "import deepspeed"])

    def unit_ucp(self, r: int) -> None:
        src = self.ckpt.tag_dir if self.cfg.ucp_src == "tag" else self.ckpt.root
        univ = self.work / "ucp-univ"
        _remove(univ)
        sample = self.run("ucp-to-universal", r, [sys.executable, "-m", "ucp", "to-universal", str(src), str(univ)])
        if sample.ok:
            self.note_disk("ucp-universal", univ)
            native = self.work / "ucp-native"
            _remove(native)
            restored = self.run("ucp-restore", r, [sys.executable, "-m", "ucp", "restore", str(univ), str(native),
                                                   "--dp", str(self.cfg.restore_dp)])
            if restored.ok:
                self.note_disk("ucp-native", native)
                if not self.cfg.skip_loads:
                    try:
                        load_dir, tag = _native_load_target(native)
                    except FileNotFoundError as exc:
                        self.record(Sample("ucp-native-load", r, False, 0.0, 0, error=str(exc)))
                    else:
                        self.run_engine("ucp-native-load", r, self.cfg.restore_dp,
                                        LoadSpec(path=str(load_dir), kind="native", tag=tag))
            _remove(native)
        _remove(univ)

    def unit_ds(self, r: int) -> None:
        root = self.work / "ds-univ"
        _remove(root)
        root.mkdir(parents=True)
        out = root / self.ckpt.tag  # ds_to_universal writes `latest_universal` next to its output folder
        n = str(self.cfg.ds_workers)
        sample = self.run("ds-to-universal", r, [
            sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(self.ckpt.tag_dir),
            "--output_folder", str(out), "--num_extract_workers", n, "--num_merge_workers", n])
        if sample.ok:
            self.note_disk("ds-universal", out)
            if not self.cfg.skip_loads:
                self.run_engine("ds-universal-load", r, self.cfg.dp, LoadSpec(path=str(root), kind="ds-universal"))
        _remove(root)

    def unit_cp(self, r: int) -> None:
        out = self.work / "cp-copy"
        _remove(out)
        self.run("cp", r, ["cp", "-r", str(self.ckpt.tag_dir), str(out)])
        _remove(out)

    def unit_engine(self, r: int) -> None:
        if not self.cfg.skip_loads:
            self.run_engine("engine-init", r, self.cfg.dp, None)

    def ds_temp_probe(self) -> None:
        """One untimed extra ds_to_universal with --keep_temp_folder: how much scratch it needs on disk."""
        root = self.work / "ds-probe"
        _remove(root)
        root.mkdir(parents=True)
        out = root / self.ckpt.tag
        n = str(self.cfg.ds_workers)
        sample = run_measured("ds-to-universal-keep-temp", -1, [([
            sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(self.ckpt.tag_dir),
            "--output_folder", str(out), "--num_extract_workers", n, "--num_merge_workers", n, "--keep_temp_folder",
        ], tool_env())], [self.logs / "ds-temp-probe.log"], self.cfg)
        if sample.ok:
            self.note_disk("ds-temp", out / "tmp")
            self.note_disk("ds-universal+temp", out)
            state = out / "zero" / "optimizer_state.pt"
            if state.is_file():
                self.disk["ds-optimizer_state.pt"] = {"bytes": state.stat().st_size, "files": 1}
        else:
            self.notes.append(f"ds temp probe failed: {(sample.error or '').splitlines()[0]}")
        _remove(root)


def _prewarm(path: Path) -> None:
    """Read the source once so that round 1's first tool does not pay the cold-cache read alone."""
    buf = bytearray(1 << 20)  # small and reused: this process's peak RSS is every child's floor
    for file in sorted(path.rglob("*")):
        if file.is_file():
            with open(file, "rb", buffering=0) as fh:
                while fh.readinto(buf):
                    pass


def measure_size(cfg: BenchConfig, size_mb: int) -> dict:
    """Build or reuse the checkpoint of ``size_mb`` and run all rounds; return the JSON-ready result."""
    ckpt = build_checkpoint(cfg, size_mb)
    key = f"{size_mb}mb"
    run = SizeRun(cfg, ckpt, work=cfg.out_dir / "work" / key, logs=cfg.out_dir / "logs" / key)
    shutil.rmtree(run.logs, ignore_errors=True)
    run.work.mkdir(parents=True, exist_ok=True)
    run.disk["source"] = dict(zip(("bytes", "files"), _dir_bytes(ckpt.tag_dir)))
    _prewarm(ckpt.tag_dir)
    load_before = os.getloadavg()
    units: list[tuple[str, Callable[[int], None]]] = [
        ("imports", run.unit_imports), ("ucp", run.unit_ucp), ("ds", run.unit_ds),
        ("cp", run.unit_cp), ("engine", run.unit_engine),
    ]
    started = time.perf_counter()
    for r in range(cfg.rounds):
        order = units[r % len(units):] + units[: r % len(units)]  # rotate so no tool always goes first
        logger.info("round %d/%d (%s)", r + 1, cfg.rounds, ", ".join(name for name, _ in order))
        for _, unit in order:
            unit(r)
    if cfg.ds_temp_probe:
        run.ds_temp_probe()
    if not cfg.keep_outputs:
        shutil.rmtree(run.work, ignore_errors=True)
    result = {
        "size_mb": size_mb,
        "checkpoint": {"path": str(ckpt.tag_dir), "bytes": ckpt.bytes_on_disk, "params_trainable": ckpt.params_trainable,
                       "model": asdict(ckpt.model), "dp": cfg.dp, "dtype": "bf16", "stage": 3, "build_s": ckpt.build_s},
        "measure_s": time.perf_counter() - started,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "samples": [asdict(s) for s in run.samples],
        "disk": run.disk,
        "notes": run.notes,
    }
    result.update(summarize(run.samples, cfg))
    busy = max(load_before[0], result["loadavg_after"][0])
    if busy > (os.cpu_count() or 1):
        result["notes"].append(f"machine was busy (1-min load average up to {busy:.1f} on {os.cpu_count()} cores): "
                               "absolute times are inflated; the alternated ratios are the numbers to read")
    return result


# --------------------------------------------------------------------------------------------- summary


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(samples: list[Sample], cfg: BenchConfig) -> dict:
    """Medians per tool, the derived work/load numbers and the ratio table against the targets."""
    tools: dict[str, dict] = {}
    for name in dict.fromkeys(s.tool for s in samples):
        runs = [s for s in samples if s.tool == name]
        good = [s for s in runs if s.ok]
        tools[name] = {
            "runs": len(runs),
            "ok": len(good),
            "wall_s_median": _median([s.wall_s for s in good]),
            "wall_s_min": min((s.wall_s for s in good), default=None),
            "wall_s_max": max((s.wall_s for s in good), default=None),
            "cpu_s_median": _median([s.cpu_s for s in good]),
            "maxrss_mib_median": _mib(_median([s.maxrss_kib for s in good])),
            "rank_sum_rss_mib_median": _mib(_median([sum(s.rank_maxrss_kib) for s in good])),
            "tree_rss_peak_mib_median": _mib(_median([s.tree_rss_peak_kib for s in good if s.tree_rss_peak_kib])),
            "first_error": next((s.error for s in runs if not s.ok), None),
        }

    def wall(name: str) -> float | None:
        return tools.get(name, {}).get("wall_s_median")

    def cpu(name: str) -> float | None:
        return tools.get(name, {}).get("cpu_s_median")

    def rss(name: str) -> float | None:
        return tools.get(name, {}).get("maxrss_mib_median")

    def minus(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    def plus(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a + b

    derived = {
        "import-torch": wall("import-torch"),
        "import-deepspeed": wall("import-deepspeed"),
        "ucp-to-universal": wall("ucp-to-universal"),
        "ds-to-universal": wall("ds-to-universal"),
        "cp": wall("cp"),
        "ucp-work": minus(wall("ucp-to-universal"), wall("import-torch")),
        "ds-work": minus(wall("ds-to-universal"), wall("import-deepspeed")),
        "ucp-rss": rss("ucp-to-universal"),
        "ds-rss": rss("ds-to-universal"),
        "ucp-cpu": cpu("ucp-to-universal"),
        "ds-cpu": cpu("ds-to-universal"),
        "ucp-cpu-work": minus(cpu("ucp-to-universal"), cpu("import-torch")),
        "ds-cpu-work": minus(cpu("ds-to-universal"), cpu("import-deepspeed")),
        "ucp-restore-work": minus(wall("ucp-restore"), wall("import-torch")),
        # load paths: time over an engine that loads nothing; ucp's path includes its restore process
        "ds-load-over-init": minus(wall("ds-universal-load"), wall("engine-init")),
        "ucp-native-load-over-init": minus(wall("ucp-native-load"), wall("engine-init")),
        "ucp-restore+load": plus(wall("ucp-restore"), wall("ucp-native-load")),
    }
    derived["ucp-restore+load-over-init"] = plus(wall("ucp-restore"), derived["ucp-native-load-over-init"])
    ratios = []
    for key, num, den, target, checked, meaning in TARGETS:
        value = _ratio(derived.get(num), derived.get(den))
        ratios.append({"name": key, "value": value, "target": target, "met": None if value is None else value <= target,
                       "checked": checked, "meaning": meaning})
    for key, num, den, meaning in (
        ("restore-path-time", "ucp-restore+load", "ds-universal-load",
         "(ucp restore + native engine load) / DS universal engine load, whole processes"),
        ("restore-path-over-init", "ucp-restore+load-over-init", "ds-load-over-init",
         "same, each minus an engine start that loads nothing"),
    ):
        den_value = derived.get(den) if den in derived else wall(den)
        ratios.append({"name": key, "value": _ratio(derived.get(num), den_value), "target": None, "met": None,
                       "checked": False, "meaning": meaning})
    return {"tools": tools, "derived": derived, "ratios": ratios}


def _mib(kib: float | None) -> float | None:
    return None if kib is None else kib / 1024


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


ROWS = (
    ("import-torch", "`python -c 'import torch'`"),
    ("import-deepspeed", "`python -c 'import deepspeed'`"),
    ("ucp-to-universal", "`ucp to-universal`"),
    ("ds-to-universal", "`ds_to_universal`"),
    ("cp", "`cp -r` shard folder"),
    ("ucp-restore", "`ucp restore --dp N`"),
    ("engine-init", "engine start, no load (ranks)"),
    ("ucp-native-load", "engine load of ucp native (ranks)"),
    ("ds-universal-load", "engine `load_universal` (ranks)"),
)


def render_markdown(result: dict, env: dict, cfg: BenchConfig) -> str:
    """The per-size table for docs/performance.md."""
    ck = result["checkpoint"]
    model = ck["model"]
    lines = [
        f"### ZeRO-3 bf16, DP={ck['dp']}, {ck['bytes'] / MB:.0f} MB checkpoint "
        f"({model['layers']} layers, hidden {model['hidden']}, ffn {model['ffn']}, vocab {model['vocab']}, "
        f"{ck['params_trainable'] / 1e6:.1f} M trainable params)",
        "",
        f"{env['cpus']} CPUs, Python {env['python']}, torch {env['torch']}, DeepSpeed {env['deepspeed']}; "
        f"{cfg.rounds} rounds, order rotated each round; ds_to_universal with {cfg.ds_workers} extract/merge workers; "
        f"load average {result['loadavg_before'][0]:.1f} before, {result['loadavg_after'][0]:.1f} after; "
        f"an empty child (`true`) reports {env['rss_floor_mib']:.0f} MiB peak RSS here.",
        "",
        "| step | ok/runs | median s | min–max s | work s | CPU s | peak RSS MiB (max proc) | sum over ranks MiB "
        "| tree RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    work = {"ucp-to-universal": result["derived"]["ucp-work"], "ds-to-universal": result["derived"]["ds-work"],
            "ucp-restore": result["derived"]["ucp-restore-work"],
            "ucp-native-load": result["derived"]["ucp-native-load-over-init"],
            "ds-universal-load": result["derived"]["ds-load-over-init"]}
    for name, label in ROWS:
        t = result["tools"].get(name)
        if t is None:
            continue
        multi = name.endswith("load") or name == "engine-init"
        lines.append(
            f"| {label} | {t['ok']}/{t['runs']} | {_fmt(t['wall_s_median'])} | "
            f"{_fmt(t['wall_s_min'])}–{_fmt(t['wall_s_max'])} | {_fmt(work.get(name))} | {_fmt(t['cpu_s_median'])} | "
            f"{_fmt(t['maxrss_mib_median'], '.0f')} | {_fmt(t['rank_sum_rss_mib_median'], '.0f') if multi else ''} | "
            f"{_fmt(t['tree_rss_peak_mib_median'], '.0f')} |")
    lines += ["", "| ratio | value | target | met | meaning |", "|---|---|---|---|---|"]
    for ratio in result["ratios"]:
        met = "" if ratio["met"] is None else ("yes" if ratio["met"] else "**no**" if ratio["checked"] else "no")
        target = "" if ratio["target"] is None else f"≤ {ratio['target']}"
        lines.append(f"| {ratio['name']} | {_fmt(ratio['value'], '.3f')} | {target} | {met} | {ratio['meaning']} |")
    if result["disk"]:
        lines += ["", "| on disk | MB | files |", "|---|---|---|"]
        for name, d in result["disk"].items():
            lines.append(f"| {name} | {d['bytes'] / MB:.1f} | {d['files']} |")
    lines += ["", "Work = median wall minus the median bare import of the library the tool loads (torch for ucp, "
              "deepspeed for ds_to_universal); for engine loads, minus an engine start that loads nothing. "
              "CPU = user+sys from `os.wait4` (includes waited-for workers; robust to a busy machine). "
              "Peak RSS = `ru_maxrss` from `os.wait4`: the largest single process of the child's tree "
              "(DeepSpeed's worker pool is not summed there); tree RSS = sampled sum over all its processes."]
    failures = [(n, t["first_error"]) for n, t in result["tools"].items() if t["first_error"]]
    for name, error in failures:
        lines += ["", f"**{name} failed**: " + error.splitlines()[0]]
    for note in result["notes"]:
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- scaling


def render_scaling(results: list[dict]) -> str:
    """One row per size: does time grow linearly and memory stay flat?"""
    lines = ["| checkpoint MB | layers | ucp s | ds s | cp s | ucp RSS MiB | ds RSS MiB | ds tree RSS MiB | "
             "ucp restore s | ucp restore RSS MiB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        tools = res["tools"]

        def get(name: str, key: str) -> float | None:
            return tools.get(name, {}).get(key)

        lines.append(
            f"| {res['checkpoint']['bytes'] / MB:.0f} | {res['checkpoint']['model']['layers']} | "
            f"{_fmt(get('ucp-to-universal', 'wall_s_median'))} | {_fmt(get('ds-to-universal', 'wall_s_median'))} | "
            f"{_fmt(get('cp', 'wall_s_median'))} | {_fmt(get('ucp-to-universal', 'maxrss_mib_median'), '.0f')} | "
            f"{_fmt(get('ds-to-universal', 'maxrss_mib_median'), '.0f')} | "
            f"{_fmt(get('ds-to-universal', 'tree_rss_peak_mib_median'), '.0f')} | "
            f"{_fmt(get('ucp-restore', 'wall_s_median'))} | {_fmt(get('ucp-restore', 'maxrss_mib_median'), '.0f')} |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    """Time and peak RSS against checkpoint size; matplotlib is a benchmark-only extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.error("--plot needs matplotlib (benchmark only): pip install matplotlib")
        return
    sizes = [r["checkpoint"]["bytes"] / MB for r in results]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = (("ucp-to-universal", "ucp to-universal", "o-"), ("ds-to-universal", "ds_to_universal", "s-"),
              ("cp", "cp -r", "^--"), ("ucp-restore", "ucp restore", "d:"))
    for name, label, style in series:
        times = [r["tools"].get(name, {}).get("wall_s_median") for r in results]
        if any(t is not None for t in times):
            ax_t.plot(sizes, [math.nan if t is None else t for t in times], style, label=label)
        if name == "cp":
            continue
        mem = [r["tools"].get(name, {}).get("maxrss_mib_median") for r in results]
        if any(m is not None for m in mem):
            ax_m.plot(sizes, [math.nan if m is None else m for m in mem], style, label=f"{label} (max process)")
    tree = [r["tools"].get("ds-to-universal", {}).get("tree_rss_peak_mib_median") for r in results]
    if any(t is not None for t in tree):
        ax_m.plot(sizes, [math.nan if t is None else t for t in tree], "s:", label="ds_to_universal (process tree)")
    ax_t.set(xlabel="checkpoint size (MB)", ylabel="median wall time (s)", title="time")
    ax_m.set(xlabel="checkpoint size (MB)", ylabel="peak RSS (MiB)", title="peak memory")
    for ax in (ax_t, ax_m):
        ax.grid(alpha=0.3)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", path)


# --------------------------------------------------------------------------------------------- main


def environment() -> dict:
    """What the numbers depend on, recorded next to them."""
    from importlib.metadata import version  # not importing the libraries: this process stays light

    try:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "ucp"], capture_output=True,
                                    text=True, check=False).stdout.strip())
    except OSError:
        commit, dirty = "", False
    probe = subprocess.run([sys.executable, "-c", "import sys, json, ucp.cli; "
                            "print(json.dumps(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules)))"],
                           capture_output=True, text=True, env=tool_env(), cwd=REPO, check=False)
    return {
        "python": platform.python_version(),
        "torch": version("torch"),
        "deepspeed": version("deepspeed"),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "ucp_commit": commit + ("+dirty" if dirty else ""),
        # ucp's CLI should not pull DeepSpeed in; the work numbers assume it imports torch only
        "ucp_cli_imports": json.loads(probe.stdout) if probe.returncode == 0 and probe.stdout.strip() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
    }


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=2000, help="checkpoint size to build (decimal MB)")
    parser.add_argument("--scaling", action="store_true", help="measure size/4, size/2 and size (or --sizes)")
    parser.add_argument("--sizes", type=str, default=None, help="comma-separated sizes in MB; implies --scaling")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dp", type=int, default=4, help="DP size of the checkpoint that is built")
    parser.add_argument("--restore-dp", type=int, default=None, help="DP size for `ucp restore` (default: --dp)")
    parser.add_argument("--hidden", type=int, default=1023, help="fixed; odd so every partition is padded")
    parser.add_argument("--ffn", type=int, default=1021, help="fixed; the model grows with layers only")
    parser.add_argument("--vocab", type=int, default=1031)
    parser.add_argument("--steps", type=int, default=1, help="training steps before the save")
    parser.add_argument("--ds-workers", type=int, default=min(4, os.cpu_count() or 1),
                        help="ds_to_universal --num_extract_workers and --num_merge_workers")
    parser.add_argument("--import-reps", type=int, default=2, help="bare-import runs per library per round")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "out")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per subprocess run, seconds")
    parser.add_argument("--sample-interval", type=float, default=0.1,
                        help="seconds between process-tree RSS samples; 0 turns the sampler off")
    parser.add_argument("--ucp-src", choices=("tag", "root"), default="tag",
                        help="pass `ucp to-universal` the shard folder (as ds_to_universal gets) or its parent")
    parser.add_argument("--skip-loads", action="store_true", help="skip the multi-rank engine load runs (slow)")
    parser.add_argument("--no-ds-temp-probe", action="store_true",
                        help="skip the extra ds_to_universal --keep_temp_folder run that sizes its scratch")
    parser.add_argument("--rebuild", action="store_true", help="rebuild cached checkpoints")
    parser.add_argument("--keep-outputs", action="store_true", help="keep benchmarks/out/work (last outputs)")
    parser.add_argument("--plot", action="store_true", help="write a PNG of time and peak RSS vs size")
    parser.add_argument("--check", action="store_true", help="exit 1 when a ratio target is missed or unmeasured")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if args.sizes:
        sizes = tuple(int(s) for s in args.sizes.split(","))
    elif args.scaling:
        sizes = (max(1, args.size_mb // 4), max(1, args.size_mb // 2), args.size_mb)
    else:
        sizes = (args.size_mb,)
    restore_dp = args.restore_dp or args.dp
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return BenchConfig(
        sizes_mb=sizes, rounds=args.rounds, dp=args.dp, restore_dp=restore_dp, hidden=args.hidden, ffn=args.ffn,
        vocab=args.vocab, steps=args.steps, ds_workers=args.ds_workers, import_reps=args.import_reps,
        out_dir=args.out_dir.resolve(), timeout_s=args.timeout, sample_interval_s=args.sample_interval,
        ucp_src=args.ucp_src, skip_loads=args.skip_loads, ds_temp_probe=not args.no_ds_temp_probe,
        rebuild=args.rebuild, keep_outputs=args.keep_outputs, plot=args.plot, check=args.check)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    floor = run_measured("floor", -1, [(["true"], tool_env())], [cfg.out_dir / "logs" / "floor.log"], cfg)
    env["rss_floor_mib"] = floor.maxrss_kib / 1024  # what an empty child reports: the parent's share
    if env["ucp_cli_imports"] is None:
        logger.warning("`import ucp.cli` fails: the ucp rows will show as failed, everything else still runs")
    elif "deepspeed" in env["ucp_cli_imports"]:
        logger.warning("`import ucp.cli` pulls in deepspeed: ucp work is still computed against the torch import")
    results = []
    for size in cfg.sizes_mb:
        result = measure_size(cfg, size)
        result["environment"] = env
        result["config"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
        env["parent_maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        markdown = render_markdown(result, env, cfg)
        stem = cfg.out_dir / f"results-{size}mb"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        stem.with_suffix(".md").write_text(markdown)
        print(markdown)
        logger.info("wrote %s.json and .md", stem)
        results.append(result)
    if len(results) > 1:
        table = render_scaling(results)
        (cfg.out_dir / "results-scaling.md").write_text(table)
        (cfg.out_dir / "results-scaling.json").write_text(
            json.dumps([{k: r[k] for k in ("size_mb", "checkpoint", "tools", "derived", "ratios")} for r in results],
                       indent=2) + "\n")
        print(table)
    if cfg.plot:
        plot(results, cfg.out_dir / ("scaling.png" if len(results) > 1 else f"results-{results[0]['size_mb']}mb.png"))
    if cfg.check:
        missed = [f"{r['size_mb']} MB {x['name']}" for r in results for x in r["ratios"]
                  if x["checked"] and not x["met"]]
        if missed:
            logger.error("targets missed or not measured: %s", ", ".join(missed))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
