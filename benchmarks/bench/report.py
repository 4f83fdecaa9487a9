"""Turning results into what people read: the per-size Markdown table, the scaling table and the plot.

Formatting only: every number shown comes from summary.py (or the result dict it fills), so a change
of wording or layout here never changes what is measured.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .common import MB, BenchConfig, logger
from .summary import TARGETS, tool_stat

#: ucp restore's peak RSS bound, drawn on the memory plot.
RESTORE_RSS_MIB = next(row[3] for row in TARGETS if row[0] == "restore-rss")

#: The per-size table's rows, in order: (tool, label).
ROWS = (
    ("import-torch", "`python -c 'import torch'`"),
    ("import-deepspeed", "`python -c 'import deepspeed'`"),
    ("ucp-to-universal", "`ucp to-universal`"),
    ("ds-to-universal", "`ds_to_universal`"),
    ("cp", "`cp -r` shard folder"),
    ("ucp-restore", "`ucp restore --dp N`"),
    ("ucp-reshard", "`ucp reshard --dp N`"),
    ("engine-init", "engine start, no load (ranks)"),
    ("ucp-native-load", "engine load of ucp native (ranks)"),
    ("ds-universal-load", "engine `load_universal` (ranks)"),
)

#: The derived number shown as "work" for a tool: its median minus the matching baseline.
WORK_OF = {
    "ucp-to-universal": "ucp-work",
    "ds-to-universal": "ds-work",
    "ucp-restore": "ucp-restore-work",
    "ucp-reshard": "ucp-reshard-work",
    "ucp-native-load": "ucp-native-load-over-init",
    "ds-universal-load": "ds-load-over-init",
}

FOOTNOTE = (
    "Work = median wall minus the median bare import of the library the tool loads (torch for ucp, "
    "deepspeed for ds_to_universal); for engine loads, minus an engine start that loads nothing. "
    "CPU = user+sys from `os.wait4` (includes waited-for workers; robust to a busy machine). "
    "Peak RSS = `ru_maxrss` from `os.wait4`: the largest single process of the child's tree "
    "(DeepSpeed's worker pool is not summed there); tree RSS = sampled sum over all its processes. "
    "Targets are checked from 500 MB (to-universal work / `cp -r` from 2 GB); below, a miss reads a plain 'no'."
)


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def _load(result: dict[str, Any]) -> str:
    """The 1-minute load average as the size's runs started: "median m (max x)"."""
    runs = result.get("loadavg_runs") or {}
    return f"median {_fmt(runs.get('median'), '.1f')} (max {_fmt(runs.get('max'), '.1f')})"


def _markdown_header(result: dict[str, Any], env: dict[str, Any], cfg: BenchConfig) -> list[str]:
    """Title (checkpoint and model), the machine/run line, and the head of the per-tool table."""
    ck = result["checkpoint"]
    model = ck["model"]
    return [
        f"### ZeRO-3 bf16, DP={ck['dp']}, {ck['bytes'] / MB:.0f} MB checkpoint "
        f"({model['layers']} layers, hidden {model['hidden']}, ffn {model['ffn']}, vocab {model['vocab']}, "
        f"{ck['params_trainable'] / 1e6:.1f} M trainable params)",
        "",
        f"{env['cpus']} CPUs, Python {env['python']}, torch {env['torch']}, DeepSpeed {env['deepspeed']}; "
        f"{cfg.rounds} rounds, order rotated each round; ds_to_universal with {cfg.ds_workers} extract/merge workers; "
        f"load average {result['loadavg_before'][0]:.1f} before, {result['loadavg_after'][0]:.1f} after, "
        f"{_load(result)} as the runs started; "
        f"an empty child (`true`) reports {env['rss_floor_mib']:.0f} MiB peak RSS here.",
        "",
        "| step | ok/runs | median s | min–max s | work s | CPU s | peak RSS MiB (max proc) | sum over ranks MiB "
        "| tree RSS MiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]


def _tool_rows(result: dict[str, Any]) -> list[str]:
    """One row per tool that ran, in ROWS order; the rank sum only for the multi-rank engine runs."""
    lines = []
    for name, label in ROWS:
        t = result["tools"].get(name)
        if t is None:
            continue
        work = result["derived"][WORK_OF[name]] if name in WORK_OF else None
        multi = name.endswith("load") or name == "engine-init"
        lines.append(
            f"| {label} | {t['ok']}/{t['runs']} | {_fmt(t['wall_s_median'])} | "
            f"{_fmt(t['wall_s_min'])}–{_fmt(t['wall_s_max'])} | {_fmt(work)} | {_fmt(t['cpu_s_median'])} | "
            f"{_fmt(t['maxrss_mib_median'], '.0f')} | {_fmt(t['rank_sum_rss_mib_median'], '.0f') if multi else ''} | "
            f"{_fmt(t['tree_rss_peak_mib_median'], '.0f')} |"
        )
    return lines


def _ratio_rows(ratios: list[dict[str, Any]]) -> list[str]:
    """The ratio table; a missed checked target is bold."""
    lines = ["", "| ratio | value | target | met | meaning |", "|---|---|---|---|---|"]
    for ratio in ratios:
        met = "" if ratio["met"] is None else ("yes" if ratio["met"] else "**no**" if ratio["checked"] else "no")
        target = "" if ratio["target"] is None else f"≤ {ratio['target']:g}"
        value = _fmt(ratio["value"], ".0f" if ratio.get("absolute") else ".3f")
        lines.append(f"| {ratio['name']} | {value} | {target} | {met} | {ratio['meaning']} |")
    return lines


def _disk_rows(disk: dict[str, dict[str, int]]) -> list[str]:
    """The on-disk table (sizes of inputs, outputs and scratch); nothing when nothing was sized."""
    if not disk:
        return []
    lines = ["", "| on disk | MB | files |", "|---|---|---|"]
    for name, d in disk.items():
        lines.append(f"| {name} | {d['bytes'] / MB:.1f} | {d['files']} |")
    return lines


def render_markdown(result: dict[str, Any], env: dict[str, Any], cfg: BenchConfig) -> str:
    """The per-size table for docs/performance.md."""
    lines = _markdown_header(result, env, cfg) + _tool_rows(result)
    lines += _ratio_rows(result["ratios"]) + _disk_rows(result["disk"])
    lines += ["", FOOTNOTE]
    failures = [(n, t["first_error"]) for n, t in result["tools"].items() if t["first_error"]]
    for name, error in failures:
        lines += ["", f"**{name} failed**: " + error.splitlines()[0]]
    for note in result["notes"]:
        lines += ["", f"Note: {note}"]
    return "\n".join(lines) + "\n"


def _scaling_row(res: dict[str, Any]) -> str:
    """One size of the series: each tool's median wall, work and peak RSS, and the load it ran under."""
    tools, derived = res["tools"], res["derived"]

    def wall(name: str) -> str:
        return _fmt(tool_stat(tools, name, "wall_s_median"))

    def rss(name: str) -> str:
        return _fmt(tool_stat(tools, name, "maxrss_mib_median"), ".0f")

    tree = _fmt(tool_stat(tools, "ds-to-universal", "tree_rss_peak_mib_median"), ".0f")
    cells = [
        f"{res['checkpoint']['bytes'] / MB:.0f}",
        str(res["checkpoint"]["model"]["layers"]),
        _load(res),
        wall("ucp-to-universal"),
        _fmt(derived["ucp-work"]),
        rss("ucp-to-universal"),
        wall("ds-to-universal"),
        _fmt(derived["ds-work"]),
        f"{rss('ds-to-universal')} ({tree})",
        wall("cp"),
        _fmt(derived["ucp-restore-work"]),
        rss("ucp-restore"),
        _fmt(derived["ucp-reshard-work"]),
        rss("ucp-reshard"),
    ]
    return "| " + " | ".join(cells) + " |"


#: The ratio columns of the scaling table, in order (names from summary.TARGETS).
SCALING_RATIOS = ("time", "work", "rss", "vs-cp", "restore-vs-cp", "restore-rss", "reshard-vs-cp")


def _ratio_cell(ratio: dict[str, Any]) -> str:
    value = _fmt(ratio["value"], ".0f" if ratio.get("absolute") else ".3f")
    return f"**{value}**" if ratio["checked"] and not ratio["met"] else value


def render_scaling(results: list[dict[str, Any]], series: list[dict[str, Any]], notes: list[str]) -> str:
    """The series: one row of measures per size, one row of ratios per size, the across-size checks, and
    a note per size that did not run."""
    done = [r for r in results if "tools" in r]
    lines = [
        "| checkpoint MB | layers | load avg | ucp s | ucp work s | ucp RSS MiB | ds s | ds work s | "
        "ds RSS MiB (tree) | cp s | restore work s | restore RSS MiB | reshard work s | reshard RSS MiB |",
        "|" + "---|" * 14,
    ]
    lines += [_scaling_row(res) for res in done]
    targets = {r["name"]: r for r in done[0]["ratios"]} if done else {}
    lines += [
        "",
        "| ratio (target) | " + " | ".join(f"{r['checkpoint']['bytes'] / MB:.0f} MB" for r in done) + " |",
        "|---|" + "---|" * len(done),
    ]
    for name in SCALING_RATIOS:
        if name in targets:
            cells = [_ratio_cell(next(x for x in r["ratios"] if x["name"] == name)) for r in done]
            lines.append(f"| {name} (<= {targets[name]['target']:g}) | " + " | ".join(cells) + " |")
    lines.append("")
    for check in series:
        met = "—" if check["met"] is None else ("yes" if check["met"] else "**no**")
        lines.append(
            f"{check['name']}: {_fmt(check['value'], '.3f')} (target <= {check['target']}, met: {met}): "
            f"{check['meaning']}."
        )
    lines += [f"\nNote: {note}" for note in notes]
    lines += ["", "Missed checked targets are bold; ratios below 500 MB (vs-cp below 2 GB) are not checked."]
    return "\n".join(lines) + "\n"


def _plot_series(ax: Any, sizes: list[float], values: list[float | None], style: str, label: str) -> None:
    """Plot ``values`` against ``sizes`` (gaps where a size has none); skip a series with no value at all."""
    if any(v is not None for v in values):
        ax.plot(sizes, [math.nan if v is None else v for v in values], style, label=label)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Time and peak RSS against checkpoint size; matplotlib is a benchmark-only extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.error("--plot needs matplotlib (benchmark only): pip install matplotlib")
        return
    results = [r for r in results if "tools" in r]  # sizes skipped for want of disk have nothing to plot
    sizes = [r["checkpoint"]["bytes"] / MB for r in results]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = (
        ("ucp-to-universal", "ucp to-universal", "o-"),
        ("ds-to-universal", "ds_to_universal", "s-"),
        ("cp", "cp -r", "^--"),
        ("ucp-restore", "ucp restore", "d:"),
        ("ucp-reshard", "ucp reshard", "v:"),
    )
    for name, label, style in series:
        _plot_series(ax_t, sizes, [tool_stat(r["tools"], name, "wall_s_median") for r in results], style, label)
        if name != "cp":
            mem = [tool_stat(r["tools"], name, "maxrss_mib_median") for r in results]
            _plot_series(ax_m, sizes, mem, style, f"{label} (max process)")
    tree = [tool_stat(r["tools"], "ds-to-universal", "tree_rss_peak_mib_median") for r in results]
    _plot_series(ax_m, sizes, tree, "s:", "ds_to_universal (process tree)")
    ax_m.axhline(RESTORE_RSS_MIB, color="grey", linestyle="--", linewidth=0.8, label="ucp restore target")
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
