#!/usr/bin/env python
"""The scale series: ucp on checkpoints large in bytes, ranks, tensors and one tensor's size (issue 40).

    python benchmarks/bench_scale.py --plot          # the whole series (about 40 min and 45 GB free here)
    python benchmarks/bench_scale.py --only ranks    # one series

Builds synthetic ZeRO-3 (and, for the stages series, ZeRO-1/2) bf16 Adam saves in DeepSpeed's exact layout (benchmarks/synth_checkpoint.py; held to real
DeepSpeed by tests/test_bench_synth.py) and measures ``ucp to-universal``, ``ucp restore``, ``ucp reshard`` and
``cp -r`` of the same bytes on each, every tool its own process (see bench/scale.py). Writes
``<out>/scale/results-scale.{json,md}`` (and ``scale.png`` with --plot): per point the median time, work (time
less the bare ``import torch``) against ``cp -r``, peak RSS above the torch import and files written per second;
the targets; a cost model fitted to the points and projected to Llama-3-70B and 405B beside zero_to_fp32's rows.
A point that would not fit on the disk (about 3.2x its bytes free) is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import Any

if __package__:  # python -m benchmarks.bench_scale
    from .bench import cost_model, scale
    from .bench.common import REPO, BenchConfig, dir_bytes, logger
    from .bench.disk import remove
    from .bench.environment import environment
else:  # python benchmarks/bench_scale.py: this folder is sys.path[0]
    from bench import cost_model, scale
    from bench.common import REPO, BenchConfig, dir_bytes, logger
    from bench.disk import remove
    from bench.environment import environment

RSS_BUDGET_MIB = 256  # issue 40: peak RSS above `import torch`, any path, any point
UCP_TOOLS = ("to-universal", "restore", "reshard", "export")  # the ucp commands a point may measure
SERIES = ("bytes", "ranks", "tensors", "tensor", "workers", "stages")


def _ints(text: str) -> list[int]:
    return [int(float(v)) for v in text.split(",") if v]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes-gb", default="2,8", help="series (a): checkpoint sizes in GB at DP 8 (default 2,8)")
    parser.add_argument("--ranks", default="8,64,512,4096", help="series (b): DP sizes at 1 GB")
    parser.add_argument("--tensors", default="1000,10000,100000", help="series (c): tensor counts at 1 GB, DP 8")
    parser.add_argument(
        "--no-big-tensor", action="store_true", help="skip (d)'s 128256 x 8192 tensor (12.6 GB; its 32000 x 8192 stays)"
    )
    parser.add_argument("--nprocs", default="1,2,4", help="series (e): torchrun processes with --distributed")
    parser.add_argument("--stages", default="1,2,3", help="series (f): ZeRO stages at 1 GB and --stages-dp")
    parser.add_argument("--stages-dp", type=int, default=512, help="series (f): the DP size (default 512)")
    parser.add_argument("--only", default="", help=f"comma-separated series to run ({','.join(SERIES)})")
    parser.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "out")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per tool run")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep built points above 2 GB (disk)")
    parser.add_argument("--plot", action="store_true", help="draw scale.png (matplotlib)")
    parser.add_argument("--again", action="store_true", help="measure points an earlier run saved under points/")
    return parser.parse_args(argv)


def _config(out: Path, timeout: float) -> BenchConfig:
    """The fields of the convert benchmark's config that the process runner reads."""
    return BenchConfig(
        sizes_mb=(), rounds=1, dp=0, restore_dp=0, reshard_dp=0, hidden=0, ffn=0, vocab=0, steps=0,
        ds_workers=0, import_reps=0, out_dir=out, timeout_s=timeout, sample_interval_s=0.2, ucp_src="root",
        skip_loads=True, ds_temp_probe=False, rebuild=False, keep_outputs=False, plot=False, check=False,
    )  # fmt: skip


def derive(points: list[dict[str, Any]], torch_import: dict[str, float]) -> None:
    """Per point and tool: work (wall less the torch import), work / cp -r, RSS above the import, files per second."""
    base_cp = next((p["tools"]["cp"]["wall_s"] for p in points if p["series"] == "bytes"), None)
    for p in points:
        cp = p["tools"].get("cp", {}).get("wall_s", base_cp)
        for tool, t in p["tools"].items():
            plain = tool.startswith("cp")
            startup = 0.0 if plain else torch_import["wall_s"]  # torchrun's processes import in parallel
            t["work_s"] = max(t["wall_s"] - startup, 0.0)
            t["work_vs_cp"] = t["work_s"] / cp if cp and not plain else None
            t["rss_above_torch_mib"] = None if plain else t["maxrss_mib"] - torch_import["maxrss_mib"]
            t["files_per_s"] = t["files_out"] / t["wall_s"] if t["wall_s"] else None


def targets(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, each with the measured value and whether it holds."""

    def pick(series: str, label: str) -> dict[str, Any] | None:
        return next((p for p in points if p["series"] == series and p["label"] == label), None)

    out: list[dict[str, Any]] = []
    worst = max(
        (
            (t["rss_above_torch_mib"], f"{p['label']} {tool}")
            for p in points
            for tool, t in p["tools"].items()
            if tool in UCP_TOOLS
        ),
        default=None,
    )
    if worst:
        out.append(
            {
                "target": f"peak RSS above import torch <= {RSS_BUDGET_MIB} MiB, every point",
                "value": f"{worst[0]:.0f} MiB ({worst[1]})",
                "holds": worst[0] <= RSS_BUDGET_MIB,
            }
        )
    big = pick("tensor", "128256 x 8192")
    if big:
        r = big["tools"]["to-universal"]["work_vs_cp"]
        out.append(
            {
                "target": "one 128256 x 8192 tensor: to-universal work / cp -r <= 1.0",
                "value": f"{r:.2f}",
                "holds": r <= 1.0,
            }
        )
    for p in (p for p in points if p["series"] == "bytes"):
        for tool in scale.TOOLS[:3]:
            r = p["tools"][tool]["work_vs_cp"]
            out.append({"target": f"{p['label']}: {tool} work / cp -r <= 1.0", "value": f"{r:.2f}", "holds": r <= 1.0})
    for series, limit in (("ranks", 1.5), ("tensors", 2.0)):  # the series' last point against its first
        ends = [p for p in points if p["series"] == series]
        if len(ends) >= 2:
            lo, hi = ends[0], ends[-1]
            for tool in scale.TOOLS[:3]:
                r = hi["tools"][tool]["wall_s"] / lo["tools"][tool]["wall_s"]
                what = f"{tool}: {hi['label']} / {lo['label']} time <= {limit:g}"
                out.append({"target": what, "value": f"{r:.2f}", "holds": r <= limit})
    return out


def render(result: dict[str, Any]) -> str:
    """The Markdown report: points, targets, cost model, projections."""
    env, imp = result["environment"], result["import_torch"]
    lines = [
        "# ucp scale series",
        "",
        f"{env.get('date', '')}, commit {env.get('ucp_commit', '?')}, {os.cpu_count()} cores, python {sys.version.split()[0]}. "
        f"`import torch`: {imp['wall_s']:.2f} s, {imp['maxrss_mib']:.0f} MiB (subtracted as start-up and memory floor).",
        "",
        "Measured at commit: "
        + "; ".join(
            f"{c}: {', '.join(dict.fromkeys(p['series'] for p in result['points'] if p.get('commit', '?') == c))}"
            for c in dict.fromkeys(p.get("commit", "?") for p in result["points"])
        )
        + ".",
        "",
        "| series | point | GB | DP | stage | tensors | tool | rounds | wall s (median) | CPU s (user+sys) | work / cp -r | peak RSS MiB (above torch) | files out | files/s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        for tool, t in p["tools"].items():
            ratio = "" if t["work_vs_cp"] is None else f"{t['work_vs_cp']:.2f}"
            above = "" if t["rss_above_torch_mib"] is None else f" ({t['rss_above_torch_mib']:+.0f})"
            lines.append(
                f"| {p['series']} | {p['label']} | {p['bytes'] / 1e9:.2f} | {p['dp']} | {p.get('stage', 3)} | {p['tensors']:,} | {tool} | {p['rounds']} "
                f"| {t['wall_s']:.2f} | {t.get('cpu_s', 0.0):.2f} | {ratio} | {t['maxrss_mib']:.0f}{above} | {t['files_out']:,} | {t['files_per_s'] or 0:,.0f} | {t['loadavg']:.1f} |"
            )
    lines += ["", "| target | measured | holds |", "|---|---|---|"]
    lines += [f"| {t['target']} | {t['value']} | {'yes' if t['holds'] else '**no**'} |" for t in result["targets"]]
    lines += [
        "",
        "Cost model (seconds = fixed + per_gb x GB + per_ktensor x ktensors + per_kfile x kfiles written + per_krank x source DP / 1000):",
        "",
    ]
    lines += [
        "| tool | fixed s | per GB s | per 1000 tensors s | per 1000 files s | per 1000 ranks s | max relative error |",
        "|---|---|---|---|---|---|---|",
    ]
    for tool, c in result["cost_model"].items():
        lines.append(
            f"| {tool} | {c['fixed']:.2f} | {c['per_gb']:.3f} | {c['per_ktensor']:.3f} | {c['per_kfile']:.3f} | {c['per_krank']:.3f} | {c['max_rel_error']:.0%} |"
        )
    lines += ["", f"Projected (fitted per-GB cost of this machine / bytes at {cost_model.DISK_GBPS:g} GB/s):", ""]
    lines += [
        "| model | GB of shards | tensors | to-universal | restore | reshard | zero_to_fp32 (weights only, published) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["projections"]:
        cells = [
            f"{_hms(row[t]['fitted_s'])} / {_hms(row[t]['disk_s'])}" if t in row else "" for t in cost_model.FIT_TOOLS
        ]
        z = row["zero_to_fp32"]
        ref = f"{_hms(z[0])} at {z[1]} GB peak" if z else ""
        lines.append(f"| {row['model']} | {row['gb']:,.0f} | {row['tensors']:,} | {' | '.join(cells)} | {ref} |")
    lines += ["", *[f"- {note}" for note in result["notes"]]]
    return "\n".join(lines) + "\n"


def _hms(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("bytes", "GB", lambda p: p["bytes"] / 1e9), ("ranks", "source DP", lambda p: p["dp"]),
              ("tensors", "tensors", lambda p: p["tensors"])]  # fmt: skip
    fig, axes = plt.subplots(2, 3, figsize=(14, 8))
    for col, (series, xlabel, x) in enumerate(panels):
        pts = [p for p in result["points"] if p["series"] == series]
        if not pts:
            continue
        for tool in pts[0]["tools"]:  # cp-universal too, where measured
            xs = [x(p) for p in pts]
            axes[0][col].plot(xs, [p["tools"][tool]["wall_s"] for p in pts], "o-", label=tool)
            if tool in UCP_TOOLS:
                axes[1][col].plot(xs, [p["tools"][tool]["rss_above_torch_mib"] for p in pts], "o-", label=tool)
        for row, ylabel in ((0, "wall s (median)"), (1, "peak RSS above import torch, MiB")):
            ax = axes[row][col]
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            if series != "bytes":
                ax.set_xscale("log")
            ax.grid(alpha=0.3)
        axes[1][col].axhline(RSS_BUDGET_MIB, color="red", ls="--", lw=1, label="budget")
        axes[0][col].legend(fontsize=8)
        axes[1][col].legend(fontsize=8)
    fig.suptitle(f"ucp on synthetic ZeRO-3 bf16 Adam saves (DeepSpeed layout), {os.cpu_count()} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    root = args.out_dir.resolve() / "scale"
    root.mkdir(parents=True, exist_ok=True)
    cfg = _config(root, args.timeout)
    only = set(args.only.split(",")) if args.only else set(SERIES)
    points = scale.plan(
        [float(v) for v in args.bytes_gb.split(",") if v] if only & {"bytes", "workers"} else [],
        _ints(args.ranks) if "ranks" in only else [],
        _ints(args.tensors) if "tensors" in only else [],
        "tensor" in only and not args.no_big_tensor,
        _ints(args.nprocs) if "workers" in only else [],
        _ints(args.stages) if "stages" in only else [],
        args.stages_dp,
        "tensor" in only,
    )
    points = [p for p in points if p.series in only or (p.series == "bytes" and "workers" in only and p is points[0])]
    notes: list[str] = []
    kept = root / "points" / "import-torch.json"  # measured with the points, kept with them
    if kept.is_file() and not args.again:
        torch_import = json.loads(kept.read_text())
    else:
        torch_import = scale.import_torch(cfg, root)
        kept.parent.mkdir(parents=True, exist_ok=True)
        kept.write_text(json.dumps(torch_import))
    done: list[dict[str, Any]] = []
    for point in points:
        free = shutil.disk_usage(root).free
        need = 3.2 * point.spec.shard_bytes() - (dir_bytes(root / "ckpt" / point.key)[0])
        kept = scale.saved_path(point, root).is_file() and not args.again  # taken as measured: needs no room
        if need > free and not kept:
            notes.append(f"{point.label} skipped: needs about {need / 1e9:.0f} GB free, {free / 1e9:.0f} GB are")
            logger.info(notes[-1])
            continue
        logger.info("measuring %s: %s", point.series, point.label)
        scale.measure(point, root, cfg, args.again)
        done.append(point.result)
        large = point.spec.shard_bytes() > 2.5 * scale.GB
        if large and not args.keep_checkpoints:
            remove(root / "ckpt" / point.key)
    derive(done, torch_import)
    model = cost_model.fit(done)
    result = {
        "environment": environment(),
        "import_torch": torch_import,
        "points": done,
        "targets": targets(done),
        "cost_model": model,
        "projections": cost_model.project(model),
        "notes": notes,
    }
    (root / "results-scale.json").write_text(json.dumps(result, indent=1, default=str))
    (root / "results-scale.md").write_text(render(result))
    if args.plot:
        plot(result, root / "scale.png")
    print((root / "results-scale.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
