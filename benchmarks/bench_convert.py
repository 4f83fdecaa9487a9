#!/usr/bin/env python
"""Benchmark ``ucp to-universal`` / ``ucp restore`` / ``ucp reshard`` against DeepSpeed's own universal path.

One command builds (or reuses) a real ZeRO-3 bf16 checkpoint at DP=4 through ``ucp.harness`` and then,
round by round with the order rotated, runs every tool as its own subprocess:

* ``python -m ucp to-universal SRC OUT``                              (ucp conversion)
* ``python -m deepspeed.checkpoint.ds_to_universal ...``              (DeepSpeed conversion)
* ``cp -r TAG_DIR OUT``                                               (the floor: copying the bytes once)
* ``python -m ucp restore UNIV OUT --dp N`` + a DP=N engine loading that native checkpoint
* ``python -m ucp reshard SRC OUT --dp M``                            (DeepSpeed to DeepSpeed, no universal copy)
* a DP=4 engine with ``checkpoint.load_universal`` loading DeepSpeed's universal directory
* a DP=4 engine that loads nothing (engine start-up, subtracted from both load paths)
* ``python -c "import torch"`` / ``python -c "import deepspeed"``     (bare import cost)

Wall time is ``time.perf_counter`` around each subprocess; peak memory is the child's ``ru_maxrss`` from
``os.wait4`` (the largest single process of the child's tree, because Linux folds in the waited-for
descendants' maximum, not their sum) plus, by default, a sampled sum of RSS over the whole process tree
(catches ``ds_to_universal``'s worker pool; counts shared pages once per process, so an upper bound).

Each run records the 1-minute load average it started under. A size whose checkpoint and outputs would not fit
on the disk (``bench.disk.NEED_FACTOR`` times its size) is skipped with a note, so ``--sizes 500,1000,2000,8000``
is safe to run anywhere. Results go to ``benchmarks/out/results-<size>mb.{json,md}``; see benchmarks/README.md. This script parses the
command line and writes the results; the work is done by the package next to it, ``benchmarks/bench/``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

if __package__:  # python -m benchmarks.bench_convert
    from .bench.common import REPO, BenchConfig, logger
    from .bench.disk import space_note
    from .bench.environment import environment, tool_env
    from .bench.fixtures import cached_bytes
    from .bench.measure import measure_size
    from .bench.process import run_measured
    from .bench.report import plot, render_markdown, render_scaling
    from .bench.summary import series_checks
else:  # python benchmarks/bench_convert.py: this folder is sys.path[0]
    from bench.common import REPO, BenchConfig, logger
    from bench.disk import space_note
    from bench.environment import environment, tool_env
    from bench.fixtures import cached_bytes
    from bench.measure import measure_size
    from bench.process import run_measured
    from bench.report import plot, render_markdown, render_scaling
    from bench.summary import series_checks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--size-mb", type=int, default=2000, help="checkpoint size to build (decimal MB)")
    parser.add_argument("--scaling", action="store_true", help="measure size/4, size/2 and size (or --sizes)")
    parser.add_argument("--sizes", type=str, default=None, help="comma-separated sizes in MB; implies --scaling")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dp", type=int, default=4, help="DP size of the checkpoint that is built")
    parser.add_argument("--restore-dp", type=int, default=None, help="DP size for `ucp restore` (default: --dp)")
    parser.add_argument("--reshard-dp", type=int, default=2, help="DP size for `ucp reshard` of the checkpoint")
    parser.add_argument("--hidden", type=int, default=1023, help="fixed; odd so every partition is padded")
    parser.add_argument("--ffn", type=int, default=1021, help="fixed; the model grows with layers only")
    parser.add_argument("--vocab", type=int, default=1031)
    parser.add_argument("--steps", type=int, default=1, help="training steps before the save")
    parser.add_argument(
        "--ds-workers",
        type=int,
        default=min(4, os.cpu_count() or 1),
        help="ds_to_universal --num_extract_workers and --num_merge_workers",
    )
    parser.add_argument("--import-reps", type=int, default=2, help="bare-import runs per library per round")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "out")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per subprocess run, seconds")
    parser.add_argument(
        "--sample-interval",
        type=float,
        default=0.1,
        help="seconds between process-tree RSS samples; 0 turns the sampler off",
    )
    parser.add_argument(
        "--ucp-src",
        choices=("tag", "root"),
        default="tag",
        help="pass `ucp to-universal` the shard folder (as ds_to_universal gets) or its parent",
    )
    parser.add_argument("--skip-loads", action="store_true", help="skip the multi-rank engine load runs (slow)")
    parser.add_argument(
        "--no-ds-temp-probe",
        action="store_true",
        help="skip the extra ds_to_universal --keep_temp_folder run that sizes its scratch",
    )
    parser.add_argument("--rebuild", action="store_true", help="rebuild cached checkpoints")
    parser.add_argument("--keep-outputs", action="store_true", help="keep benchmarks/out/work (last outputs)")
    parser.add_argument("--plot", action="store_true", help="write a PNG of time and peak RSS vs size")
    parser.add_argument("--check", action="store_true", help="exit 1 when a ratio target is missed or unmeasured")
    parser.add_argument("-v", "--verbose", action="store_true")
    return parser


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    """The command line as a BenchConfig; also sets up logging."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
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
        sizes_mb=sizes,
        rounds=args.rounds,
        dp=args.dp,
        restore_dp=restore_dp,
        reshard_dp=args.reshard_dp,
        hidden=args.hidden,
        ffn=args.ffn,
        vocab=args.vocab,
        steps=args.steps,
        ds_workers=args.ds_workers,
        import_reps=args.import_reps,
        out_dir=args.out_dir.resolve(),
        timeout_s=args.timeout,
        sample_interval_s=args.sample_interval,
        ucp_src=args.ucp_src,
        skip_loads=args.skip_loads,
        ds_temp_probe=not args.no_ds_temp_probe,
        rebuild=args.rebuild,
        keep_outputs=args.keep_outputs,
        plot=args.plot,
        check=args.check,
    )


def measure_environment(cfg: BenchConfig) -> dict[str, Any]:
    """environment() plus the peak RSS an empty child reports (this process's share); warns about ucp.cli."""
    env = environment()
    floor = run_measured("floor", -1, [(["true"], tool_env())], [cfg.out_dir / "logs" / "floor.log"], cfg)
    env["rss_floor_mib"] = floor.maxrss_kib / 1024  # what an empty child reports: the parent's share
    if env["ucp_cli_imports"] is None:
        logger.warning("`import ucp.cli` fails: the ucp rows will show as failed, everything else still runs")
    elif "deepspeed" in env["ucp_cli_imports"]:
        logger.warning("`import ucp.cli` pulls in deepspeed: ucp work is still computed against the torch import")
    return env


def run_size(cfg: BenchConfig, size: int, env: dict[str, Any]) -> dict[str, Any]:
    """Measure one size, write results-<size>mb.{json,md} and print the Markdown; a size whose checkpoint
    and outputs do not fit on the disk is skipped with a note (``{"size_mb", "skipped"}``)."""
    note = space_note(cfg.out_dir, size, cached_bytes(cfg, size))
    if note is not None:
        logger.warning("%s", note)
        return {"size_mb": size, "skipped": note}
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
    return result


def write_scaling(cfg: BenchConfig, results: list[dict[str, Any]], series: list[dict[str, Any]]) -> None:
    """results-scaling.{md,json} across sizes (skipped sizes as their note), and print the tables."""
    notes = [r["skipped"] for r in results if "skipped" in r]
    table = render_scaling(results, series, notes)
    (cfg.out_dir / "results-scaling.md").write_text(table)
    keys = ("size_mb", "checkpoint", "loadavg_before", "loadavg_after", "loadavg_runs", "tools", "derived", "ratios")
    sizes = [{k: r[k] for k in keys} if "tools" in r else r for r in results]
    (cfg.out_dir / "results-scaling.json").write_text(json.dumps({"sizes": sizes, "series": series}, indent=2) + "\n")
    print(table)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    env = measure_environment(cfg)
    results = [run_size(cfg, size, env) for size in cfg.sizes_mb]
    measured = [r for r in results if "tools" in r]
    series = series_checks(measured)
    if len(results) > 1:
        write_scaling(cfg, results, series)
    if cfg.plot and measured:
        plot(measured, cfg.out_dir / ("scaling.png" if len(results) > 1 else f"results-{results[0]['size_mb']}mb.png"))
    if cfg.check:
        rows = [(f"{r['size_mb']} MB", x) for r in measured for x in r["ratios"]] + [("series", x) for x in series]
        missed = [f"{where} {x['name']}" for where, x in rows if x["checked"] and not x["met"]]
        if missed:
            logger.error("targets missed or not measured: %s", ", ".join(missed))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
