"""The scale series (issue 40): ucp on checkpoints large in bytes, ranks, tensors and single-tensor size, and the
ZeRO stages side by side.

Each point is a synthetic ZeRO-3 (the stages series: ZeRO-1, 2 and 3) bf16 Adam save (``bench.shapes`` + ``benchmarks/synth_checkpoint.py``, held to
real DeepSpeed by tests/test_bench_synth.py), built once into ``<out>/scale/ckpt/<key>/`` and measured tool by
tool, each tool its own process, the order rotated round by round: ``ucp to-universal``, ``ucp restore`` (from
the universal folder to-universal wrote, at the source's DP), ``ucp reshard`` (to half the DP) and ``cp -r`` of
the same bytes (the floor), and where a weight is cast as it is written ``ucp export`` of that universal folder
(safetensors in the model dtype). The worker series runs to-universal and restore of the 2 GB point with ``--workers``
1 and 2 and under ``torchrun --nproc-per-node N ... --distributed``. Nothing here imports torch or ucp.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import REPO, BenchConfig, dir_bytes, logger
from .disk import prewarm, remove
from .environment import git_commit, tool_env
from .process import Sample, run_measured
from .shapes import SynthSpec, layers_for_bytes, many_tensors, one_tensor

GB = 1_000_000_000
BUILDER = REPO / "benchmarks" / "synth_checkpoint.py"
TOOLS = ("to-universal", "restore", "reshard", "cp")
#: with many tensors, also the floor for writing that many files: cp -r of the universal folder to-universal wrote
MANY_FILES_TOOLS = (*TOOLS, "cp-universal")
#: where a weight is cast to the model dtype as it is written (ZeRO-1/2 restores, exports): also ``ucp export``
CAST_TOOLS = (*TOOLS, "export")


@dataclass
class Point:
    """One measured checkpoint and how it is measured."""

    series: str  # bytes | ranks | tensors | tensor | workers | stages
    label: str
    spec: SynthSpec
    rounds: int
    tools: tuple[str, ...] = TOOLS
    flags: tuple[str, ...] = ()  # extra ucp flags (--workers N)
    nproc: int = 0  # > 0: torchrun with this many processes and --distributed
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        raw = json.dumps(self.spec.to_json(), sort_keys=True)
        return f"{self.spec.label or 'ckpt'}-dp{self.spec.dp}-{hashlib.sha1(raw.encode()).hexdigest()[:12]}"


def plan(
    bytes_gb: list[float],
    ranks: list[int],
    tensors: list[int],
    big_tensor: bool,
    nprocs: list[int],
    stages: Sequence[int] = (),
    stages_dp: int = 512,
    tensor: bool = False,
) -> list[Point]:
    """The series' points: (a) bytes at DP 8, (b) DP at 1 GB, (c) tensor count at 1 GB, (d) one 128256 x 8192
    tensor (``big_tensor``) and, with ``tensor``, one 32000 x 8192 tensor at ZeRO-2, (e) workers and torchrun
    processes at the first bytes point, (f) each ZeRO stage at 1 GB and ``stages_dp``."""
    points = [
        Point(
            "bytes",
            f"{gb:g} GB",
            SynthSpec(layers_for_bytes(int(gb * GB)), dp=8, label=f"bytes{gb:g}"),
            3 if gb <= 2 else 1,
        )
        for gb in bytes_gb
    ]
    points += [Point("ranks", f"DP {dp}", SynthSpec(layers_for_bytes(GB), dp=dp, label="ranks"), 3) for dp in ranks]
    points += [
        Point(
            "tensors",
            f"{n:,} tensors",
            SynthSpec(many_tensors(n, GB // 12), dp=8, label=f"tensors{n}"),
            3 if n <= 1000 else 1,  # 10^5 tensors: minutes per run on this disk
            MANY_FILES_TOOLS,
        )
        for n in tensors
    ]
    if big_tensor:
        points.append(Point("tensor", "128256 x 8192", SynthSpec(one_tensor(128256, 8192), dp=8, label="embed"), 1))
    if tensor:  # ZeRO-2 keeps the whole bf16 weight in its model file: restore and export cast a 1 GB master
        z2 = SynthSpec(one_tensor(32000, 8192), dp=8, stage=2, label="embed-z2")
        points.append(Point("tensor", "32000 x 8192, ZeRO-2", z2, 1, CAST_TOOLS))
    points += [
        Point(
            "stages",
            f"ZeRO-{st}",
            SynthSpec(layers_for_bytes(GB), dp=stages_dp, stage=st, label=f"stage{st}"),
            3,
            CAST_TOOLS,
        )
        for st in stages
    ]
    if bytes_gb:
        base = points[0].spec
        points += [
            Point("workers", f"--workers {w}", base, 3, ("to-universal", "restore"), ("--workers", str(w)))
            for w in (1, 2)
        ]
        points += [Point("workers", f"torchrun x{n}", base, 3, ("to-universal", "restore"), nproc=n) for n in nprocs]
    return points


def build(point: Point, root: Path) -> tuple[Path, float | None]:
    """The point's checkpoint folder (holding ``latest``), built unless a finished build is cached; build seconds."""
    home = root / "ckpt" / point.key
    marker = home / "build.json"
    if marker.is_file():
        return home / "ckpt", json.loads(marker.read_text()).get("build_s")
    remove(home)
    home.mkdir(parents=True)
    (home / "spec.json").write_text(json.dumps(point.spec.to_json()))
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, str(BUILDER), str(home / "spec.json"), str(home / "ckpt"), "--jobs", "2"],
        check=True,
        env=tool_env(),
    )
    build_s = time.perf_counter() - start
    marker.write_text(json.dumps({"build_s": build_s, "bytes": dir_bytes(home / "ckpt")[0]}))
    logger.info("built %s in %.1f s", point.key, build_s)
    return home / "ckpt", build_s


def _command(point: Point, verb: str, *args: object) -> list[str]:
    tail = [verb, *map(str, args), *point.flags]
    if point.nproc:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={point.nproc}",
            "-m",
            "ucp",
            *tail,
            "--distributed",
        ]
    return [sys.executable, "-m", "ucp", *tail]


def _units(point: Point, ckpt: Path, work: Path) -> dict[str, Callable[[], tuple[list[str], Path]]]:
    """Per tool: a function giving (command, output folder); restore reads ``work/u``, which is kept for it."""
    tag = ckpt / (ckpt / "latest").read_text().strip()
    half = max(1, point.spec.dp // 2)
    return {
        "to-universal": lambda: (_command(point, "to-universal", ckpt, work / "u-new"), work / "u-new"),
        "restore": lambda: (_command(point, "restore", work / "u", work / "out", "--dp", point.spec.dp), work / "out"),
        "reshard": lambda: (_command(point, "reshard", ckpt, work / "out", "--dp", half), work / "out"),
        "cp": lambda: (["cp", "-r", str(tag), str(work / "out")], work / "out"),
        "cp-universal": lambda: (["cp", "-r", str(work / "u"), str(work / "out")], work / "out"),
        "export": lambda: (_command(point, "export", work / "u", work / "out"), work / "out"),
    }


def saved_path(point: Point, root: Path) -> Path:
    """Where a measured point's result is kept, named for everything that decides it."""
    how = "-".join([point.series, *point.tools, *point.flags, f"n{point.nproc}", f"r{point.rounds}"])
    return root / "points" / f"{point.key}-{hashlib.sha1(how.encode()).hexdigest()[:8]}.json"


def measure(point: Point, root: Path, cfg: BenchConfig, again: bool = False) -> None:
    """Build the point, make the universal folder restore reads, then run every tool ``rounds`` times; a point
    measured by an earlier run of the series is taken from its saved result unless ``again``."""
    saved = saved_path(point, root)
    if saved.is_file() and not again:
        point.result = json.loads(saved.read_text())
        logger.info("%s: %s taken from %s", point.series, point.label, saved.name)
        return
    _measure(point, root, cfg)
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps(point.result))


def _measure(point: Point, root: Path, cfg: BenchConfig) -> None:
    ckpt, build_s = build(point, root)
    work = root / "work" / point.key
    remove(work)
    work.mkdir(parents=True)
    nbytes, nfiles = dir_bytes(ckpt)
    if nbytes < 4 * GB:  # larger ones do not stay in this machine's page cache anyway
        prewarm(ckpt)
    units = _units(point, ckpt, work)
    logs = root / "logs" / point.key
    samples: list[Sample] = []
    files_out: dict[str, int] = {}
    tools = point.tools
    if {"restore", "cp-universal", "export"} & set(tools):  # they read the universal folder: write it first
        cmd, out = units["to-universal"]()
        first = run_measured("to-universal", 0, [(cmd, tool_env())], [logs / "to-universal-first.log"], cfg)
        if not first.ok:
            raise SystemExit(f"{point.label}: to-universal failed: {first.error}")
        files_out["to-universal"] = dir_bytes(out)[1]
        out.rename(work / "u")
        if point.rounds == 1:  # one round: that run is its sample
            samples.append(first)
            tools = tuple(t for t in tools if t != "to-universal")
    for round_ in range(point.rounds):
        order = tools[round_ % len(tools) :] + tools[: round_ % len(tools)]
        for tool in order:
            cmd, out = units[tool]()
            sample = run_measured(tool, round_, [(cmd, tool_env())], [logs / f"{tool}-{round_}.log"], cfg)
            if not sample.ok:
                raise SystemExit(f"{point.label}: {tool} failed: {sample.error}")
            files_out[tool] = dir_bytes(out)[1]
            samples.append(sample)
            remove(out)
    remove(work)
    point.result = {
        "series": point.series,
        "label": point.label,
        "dp": point.spec.dp,
        "stage": point.spec.stage,
        "tensors": len(point.spec.params),
        "largest_tensor": max(p.numel for p in point.spec.params),
        "bytes": nbytes,
        "files_in": nfiles,
        "build_s": build_s,
        "rounds": point.rounds,
        "flags": list(point.flags),
        "nproc": point.nproc,
        "commit": git_commit(),  # a rerun of some series leaves the others as they were measured
        "tools": {tool: _stats([s for s in samples if s.tool == tool], files_out.get(tool, 0)) for tool in point.tools},
    }


def _stats(samples: list[Sample], files_out: int) -> dict[str, Any]:
    wall = statistics.median(s.wall_s for s in samples)
    return {
        "wall_s": wall,
        "walls": [round(s.wall_s, 3) for s in samples],
        "maxrss_mib": max(s.maxrss_kib for s in samples) / 1024,
        "tree_rss_mib": max((s.tree_rss_peak_kib or 0) for s in samples) / 1024,
        "cpu_s": statistics.median(s.cpu_s for s in samples),
        "files_out": files_out,
        "loadavg": statistics.median(s.loadavg_1m or 0.0 for s in samples),
    }


def import_torch(cfg: BenchConfig, root: Path, reps: int = 5) -> dict[str, float]:
    """Median wall time and peak RSS of ``python -c "import torch"`` (subtracted as the start-up cost)."""
    samples = [
        run_measured(
            "import torch",
            i,
            [([sys.executable, "-c", "import torch"], tool_env())],
            [root / "logs" / "import.log"],
            cfg,
        )
        for i in range(reps)
    ]
    return {
        "wall_s": statistics.median(s.wall_s for s in samples),
        "maxrss_mib": max(s.maxrss_kib for s in samples) / 1024,
    }
