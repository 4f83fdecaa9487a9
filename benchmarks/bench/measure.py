"""What is measured for one checkpoint size: ucp, ds_to_universal, cp and the engine loads, round by round.

Each "unit" runs one tool (and what depends on its output) and cleans up after itself, so that units
can run in any order; measure_size rotates that order each round and hands back the JSON-ready result.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .common import BenchConfig, LoadSpec, RunSpec, dir_bytes, global_batch, logger
from .disk import fresh_dir, native_load_target, prewarm, remove
from .environment import tool_env
from .fixtures import Checkpoint, build_checkpoint
from .process import Sample, rank_jobs, run_measured
from .summary import summarize


def _ucp_cmd(verb: str, *args: object) -> list[str]:
    """``python -m ucp VERB ARGS...``: each ucp tool as its own process, as a user runs it."""
    return [sys.executable, "-m", "ucp", verb, *(str(a) for a in args)]


def _ds_to_universal_cmd(src: Path, out: Path, workers: int, *extra: str) -> list[str]:
    """``python -m deepspeed.checkpoint.ds_to_universal`` with ``workers`` extract and merge workers."""
    n = str(workers)
    return [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(src),
        "--output_folder",
        str(out),
        "--num_extract_workers",
        n,
        "--num_merge_workers",
        n,
        *extra,
    ]


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
            logger.warning(
                "  r%d %-22s FAILED after %.2f s: %s",
                sample.round,
                sample.tool,
                sample.wall_s,
                (sample.error or "").splitlines()[0],
            )
        return sample

    def run(self, tool: str, round_: int, cmd: list[str]) -> Sample:
        return self.record(
            run_measured(tool, round_, [(cmd, tool_env())], [self.logs / f"r{round_}-{tool}.log"], self.cfg)
        )

    def run_engine(self, tool: str, round_: int, dp: int, load: LoadSpec | None) -> Sample:
        spec = RunSpec(
            dp=dp,
            stage=3,
            dtype="bf16",
            model=self.ckpt.model,
            global_batch=global_batch(self.cfg),
            seq=8,
            steps=0,
            load=load,
        )
        logs = [self.logs / f"r{round_}-{tool}-rank{r}.log" for r in range(dp)]
        return self.record(run_measured(tool, round_, rank_jobs(spec), logs, self.cfg))

    def note_disk(self, name: str, path: Path) -> None:
        if name not in self.disk:
            nbytes, files = dir_bytes(path)
            self.disk[name] = {"bytes": nbytes, "files": files}

    # Each unit is independent of the others' order; units that produce outputs delete them at the end.

    def unit_imports(self, r: int) -> None:
        for _ in range(self.cfg.import_reps):
            self.run("import-torch", r, [sys.executable, "-c", "import torch"])
            self.run("import-deepspeed", r, [sys.executable, "-c", "import deepspeed"])

    def unit_ucp(self, r: int) -> None:
        src = self.ckpt.tag_dir if self.cfg.ucp_src == "tag" else self.ckpt.root
        univ = self.work / "ucp-univ"
        remove(univ)
        sample = self.run("ucp-to-universal", r, _ucp_cmd("to-universal", src, univ))
        if sample.ok:
            self.note_disk("ucp-universal", univ)
            self._ucp_restore(r, univ)
        remove(univ)

    def _ucp_restore(self, r: int, univ: Path) -> None:
        """``ucp restore`` of ucp's universal output, then (unless --skip-loads) an engine loading it."""
        native = self.work / "ucp-native"
        remove(native)
        restored = self.run("ucp-restore", r, _ucp_cmd("restore", univ, native, "--dp", self.cfg.restore_dp))
        if restored.ok:
            self.note_disk("ucp-native", native)
            if not self.cfg.skip_loads:
                self._ucp_native_load(r, native)
        remove(native)

    def _ucp_native_load(self, r: int, native: Path) -> None:
        try:
            load_dir, tag = native_load_target(native)
        except FileNotFoundError as exc:
            self.record(Sample("ucp-native-load", r, False, 0.0, 0, error=str(exc)))
        else:
            self.run_engine(
                "ucp-native-load",
                r,
                self.cfg.restore_dp,
                LoadSpec(path=str(load_dir), kind="native", tag=tag),
            )

    def unit_reshard(self, r: int) -> None:
        """``ucp reshard`` of the same checkpoint to --reshard-dp: DeepSpeed to DeepSpeed, no universal copy."""
        out = self.work / "ucp-reshard"
        remove(out)
        sample = self.run("ucp-reshard", r, _ucp_cmd("reshard", self.ckpt.tag_dir, out, "--dp", self.cfg.reshard_dp))
        if sample.ok:
            self.note_disk("ucp-reshard", out)
        remove(out)

    def unit_ds(self, r: int) -> None:
        root = self.work / "ds-univ"
        fresh_dir(root)
        out = root / self.ckpt.tag  # ds_to_universal writes `latest_universal` next to its output folder
        sample = self.run("ds-to-universal", r, _ds_to_universal_cmd(self.ckpt.tag_dir, out, self.cfg.ds_workers))
        if sample.ok:
            self.note_disk("ds-universal", out)
            if not self.cfg.skip_loads:
                self.run_engine("ds-universal-load", r, self.cfg.dp, LoadSpec(path=str(root), kind="ds-universal"))
        remove(root)

    def unit_cp(self, r: int) -> None:
        out = self.work / "cp-copy"
        remove(out)
        self.run("cp", r, ["cp", "-r", str(self.ckpt.tag_dir), str(out)])
        remove(out)

    def unit_engine(self, r: int) -> None:
        if not self.cfg.skip_loads:
            self.run_engine("engine-init", r, self.cfg.dp, None)

    def ds_temp_probe(self) -> None:
        """One untimed extra ds_to_universal with --keep_temp_folder: how much scratch it needs on disk."""
        root = self.work / "ds-probe"
        fresh_dir(root)
        out = root / self.ckpt.tag
        cmd = _ds_to_universal_cmd(self.ckpt.tag_dir, out, self.cfg.ds_workers, "--keep_temp_folder")
        sample = run_measured(
            "ds-to-universal-keep-temp", -1, [(cmd, tool_env())], [self.logs / "ds-temp-probe.log"], self.cfg
        )
        if sample.ok:
            self.note_disk("ds-temp", out / "tmp")
            self.note_disk("ds-universal+temp", out)
            state = out / "zero" / "optimizer_state.pt"
            if state.is_file():
                self.disk["ds-optimizer_state.pt"] = {"bytes": state.stat().st_size, "files": 1}
        else:
            self.notes.append(f"ds temp probe failed: {(sample.error or '').splitlines()[0]}")
        remove(root)

    def run_rounds(self) -> None:
        """``cfg.rounds`` rounds of every unit, the order rotated each round so no tool always goes first."""
        units: list[tuple[str, Callable[[int], None]]] = [
            ("imports", self.unit_imports),
            ("ucp", self.unit_ucp),
            ("reshard", self.unit_reshard),
            ("ds", self.unit_ds),
            ("cp", self.unit_cp),
            ("engine", self.unit_engine),
        ]
        for r in range(self.cfg.rounds):
            order = units[r % len(units) :] + units[: r % len(units)]
            logger.info("round %d/%d (%s)", r + 1, self.cfg.rounds, ", ".join(name for name, _ in order))
            for _, unit in order:
                unit(r)


def _load_stats(samples: list[Sample]) -> dict[str, float | None]:
    """The 1-minute load average as each measured run started: median and max over the size's runs."""
    loads = sorted(s.loadavg_1m for s in samples if s.loadavg_1m is not None)
    return {"median": statistics.median(loads) if loads else None, "max": loads[-1] if loads else None}


def measure_size(cfg: BenchConfig, size_mb: int) -> dict[str, Any]:
    """Build or reuse the checkpoint of ``size_mb`` and run all rounds; return the JSON-ready result."""
    ckpt = build_checkpoint(cfg, size_mb)
    key = f"{size_mb}mb"
    run = SizeRun(cfg, ckpt, work=cfg.out_dir / "work" / key, logs=cfg.out_dir / "logs" / key)
    shutil.rmtree(run.logs, ignore_errors=True)
    run.work.mkdir(parents=True, exist_ok=True)
    run.disk["source"] = dict(zip(("bytes", "files"), dir_bytes(ckpt.tag_dir)))
    prewarm(ckpt.tag_dir)
    load_before = os.getloadavg()
    started = time.perf_counter()
    run.run_rounds()
    if cfg.ds_temp_probe:
        run.ds_temp_probe()
    if not cfg.keep_outputs:
        shutil.rmtree(run.work, ignore_errors=True)
    result: dict[str, Any] = {
        "size_mb": size_mb,
        "checkpoint": {
            "path": str(ckpt.tag_dir),
            "bytes": ckpt.bytes_on_disk,
            "params_trainable": ckpt.params_trainable,
            "model": asdict(ckpt.model),
            "dp": cfg.dp,
            "dtype": "bf16",
            "stage": 3,
            "build_s": ckpt.build_s,
        },
        "measure_s": time.perf_counter() - started,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "loadavg_runs": _load_stats(run.samples),
        "samples": [asdict(s) for s in run.samples],
        "disk": run.disk,
        "notes": run.notes,
    }
    native = run.disk.get("ucp-native")
    share = native["bytes"] / cfg.restore_dp / 2**20 if native else None
    result.update(summarize(run.samples, size_mb, rank_share_mib=share))
    busy = max(load_before[0], result["loadavg_after"][0], result["loadavg_runs"]["max"] or 0.0)
    if busy > (os.cpu_count() or 1):
        result["notes"].append(
            f"machine was busy (1-min load average up to {busy:.1f} on {os.cpu_count()} cores): "
            "absolute times are inflated; the alternated ratios are the numbers to read"
        )
    return result
