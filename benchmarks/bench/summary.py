"""From raw samples to the numbers that are reported: medians per tool, derived work, ratios vs targets.

Pure functions over plain data (no processes, no files), so the arithmetic behind docs/performance.md
can be read and checked on its own; the report module only formats what this returns.
"""

from __future__ import annotations

import statistics
from typing import Any

from .process import Sample

#: Ratio targets (issues 9 and 21): (name, numerator, denominator, target, checked, meaning). A denominator
#: of None makes the row an absolute bound on the numerator. The CPU-time rows are not what the targets are
#: defined on, but they survive a busy machine far better than wall time does (user+sys of the child and
#: every descendant it waited for, from wait4).
TARGETS = (
    ("time", "ucp-to-universal", "ds-to-universal", 0.25, True, "whole-process wall time, ucp / ds_to_universal"),
    ("work", "ucp-work", "ds-work", 0.10, True, "wall minus bare import of the heavy library, ucp / ds_to_universal"),
    ("rss", "ucp-rss", "ds-rss", 0.50, True, "peak RSS (wait4 ru_maxrss), ucp / ds_to_universal"),
    ("vs-cp", "ucp-work", "cp", 1.2, True, "ucp to-universal work / `cp -r` of the shard folder (checked from 2 GB)"),
    ("restore-vs-cp", "ucp-restore-work", "cp", 2.5, True, "ucp restore work / `cp -r` of the shard folder"),
    ("restore-rss", "ucp-restore-rss", None, 320.0, True, "ucp restore's peak RSS in MiB (an absolute bound)"),
    ("reshard-vs-cp", "ucp-reshard-work", "cp", 3.0, True, "ucp reshard work / `cp -r` of the shard folder"),
    ("cpu-time", "ucp-cpu", "ds-cpu", 0.25, False, "CPU time (user+sys, whole tree), ucp / ds_to_universal"),
    ("cpu-work", "ucp-cpu-work", "ds-cpu-work", 0.10, False, "CPU time minus the bare import's, ucp / ds"),
)

#: Checked targets hold for the series' sizes; below this size (the CI run, quick checks) they are reported
#: only, because there the fixed costs of starting a process are the measure. Per target where it differs.
CHECKED_FROM_MB = 500
CHECKED_FROM_MB_OF = {"vs-cp": 2000}

#: Ratios reported without a target: (name, numerator, denominator, meaning); a denominator that is not
#: a derived number is a tool's median wall time.
UNTARGETED = (
    (
        "restore-rss-share",
        "ucp-restore-rss-over-import",
        "rank-share",
        "ucp restore's peak RSS over import torch's / one new rank's share of the output",
    ),
    (
        "reshard-vs-ds-to-universal",
        "ucp-reshard-work",
        "ds-work",
        "ucp reshard work / ds_to_universal work (only the first half of DeepSpeed's route)",
    ),
    (
        "reshard-vs-ds-route",
        "ucp-reshard",
        "ds-route",
        "ucp reshard / (ds_to_universal + engine load_universal over an idle engine start), whole processes",
    ),
    (
        "restore-path-time",
        "ucp-restore+load",
        "ds-universal-load",
        "(ucp restore + native engine load) / DS universal engine load, whole processes",
    ),
    (
        "restore-path-over-init",
        "ucp-restore+load-over-init",
        "ds-load-over-init",
        "same, each minus an engine start that loads nothing",
    ),
)

#: Across the sizes of one series: ucp restore's peak RSS may spread by at most this fraction of its smallest.
RESTORE_RSS_FLAT = 0.10


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _mib(kib: float | None) -> float | None:
    return None if kib is None else kib / 1024


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is not positive."""
    return None if a is None or b is None or b <= 0 else a / b


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _plus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def tool_stat(tools: dict[str, dict[str, Any]], name: str, key: str) -> Any:
    """One statistic of one tool from a ``tools`` table; None when the tool was not run."""
    return tools.get(name, {}).get(key)


def tool_stats(samples: list[Sample]) -> dict[str, dict[str, Any]]:
    """Per tool, in order of first appearance: run counts, medians and extremes over the good runs."""
    tools: dict[str, dict[str, Any]] = {}
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
    return tools


def derive(tools: dict[str, dict[str, Any]], rank_share_mib: float | None = None) -> dict[str, float | None]:
    """The numbers the ratios are taken of: medians, and medians minus a baseline (bare import, idle engine).
    ``rank_share_mib``: the native output's size over the restore's DP size (what one rank's buffers hold)."""

    def wall(name: str) -> float | None:
        return tool_stat(tools, name, "wall_s_median")

    def cpu(name: str) -> float | None:
        return tool_stat(tools, name, "cpu_s_median")

    def rss(name: str) -> float | None:
        return tool_stat(tools, name, "maxrss_mib_median")

    derived = {
        "import-torch": wall("import-torch"),
        "import-deepspeed": wall("import-deepspeed"),
        "ucp-to-universal": wall("ucp-to-universal"),
        "ds-to-universal": wall("ds-to-universal"),
        "cp": wall("cp"),
        "ucp-work": _minus(wall("ucp-to-universal"), wall("import-torch")),
        "ds-work": _minus(wall("ds-to-universal"), wall("import-deepspeed")),
        "ucp-rss": rss("ucp-to-universal"),
        "ds-rss": rss("ds-to-universal"),
        "ucp-cpu": cpu("ucp-to-universal"),
        "ds-cpu": cpu("ds-to-universal"),
        "ucp-cpu-work": _minus(cpu("ucp-to-universal"), cpu("import-torch")),
        "ds-cpu-work": _minus(cpu("ds-to-universal"), cpu("import-deepspeed")),
        "ucp-restore-work": _minus(wall("ucp-restore"), wall("import-torch")),
        "ucp-restore-rss": rss("ucp-restore"),
        "ucp-restore-rss-over-import": _minus(rss("ucp-restore"), rss("import-torch")),
        "ucp-reshard": wall("ucp-reshard"),
        "ucp-reshard-work": _minus(wall("ucp-reshard"), wall("import-torch")),
        "ucp-reshard-rss": rss("ucp-reshard"),
        "rank-share": rank_share_mib,
        # load paths: time over an engine that loads nothing; ucp's path includes its restore process
        "ds-load-over-init": _minus(wall("ds-universal-load"), wall("engine-init")),
        "ucp-native-load-over-init": _minus(wall("ucp-native-load"), wall("engine-init")),
        "ucp-restore+load": _plus(wall("ucp-restore"), wall("ucp-native-load")),
    }
    derived["ucp-restore+load-over-init"] = _plus(wall("ucp-restore"), derived["ucp-native-load-over-init"])
    derived["ds-route"] = _plus(wall("ds-to-universal"), derived["ds-load-over-init"])
    return derived


def ratios(derived: dict[str, float | None], tools: dict[str, dict[str, Any]], size_mb: int) -> list[dict[str, Any]]:
    """The ratio table: every TARGETS row against its target (checked at the sizes it is stated for), then
    the UNTARGETED rows."""
    rows = []
    for key, num, den, target, checked, meaning in TARGETS:
        value = derived.get(num) if den is None else _ratio(derived.get(num), derived.get(den))
        rows.append(
            {
                "name": key,
                "value": value,
                "target": target,
                "met": None if value is None else value <= target,
                "checked": checked and size_mb >= CHECKED_FROM_MB_OF.get(key, CHECKED_FROM_MB),
                "absolute": den is None,
                "meaning": meaning,
            }
        )
    for key, num, den, meaning in UNTARGETED:
        den_value = derived.get(den) if den in derived else tool_stat(tools, den, "wall_s_median")
        rows.append(
            {
                "name": key,
                "value": _ratio(derived.get(num), den_value),
                "target": None,
                "met": None,
                "checked": False,
                "meaning": meaning,
            }
        )
    return rows


def summarize(samples: list[Sample], size_mb: int, rank_share_mib: float | None = None) -> dict[str, Any]:
    """Medians per tool, the derived work/load numbers and the ratio table against the targets."""
    tools = tool_stats(samples)
    derived = derive(tools, rank_share_mib)
    return {"tools": tools, "derived": derived, "ratios": ratios(derived, tools, size_mb)}


def series_checks(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Targets over a whole series (rows shaped like ``ratios``'): ucp restore's peak RSS stays flat."""
    rss = [r["derived"].get("ucp-restore-rss") for r in results if "derived" in r]
    measured = [v for v in rss if v is not None]
    spread = (max(measured) - min(measured)) / min(measured) if len(measured) > 1 and min(measured) > 0 else None
    return [
        {
            "name": "restore-rss-flat",
            "value": spread,
            "target": RESTORE_RSS_FLAT,
            "met": None if spread is None else spread <= RESTORE_RSS_FLAT,
            "checked": len(measured) > 1,
            "meaning": "(max - min) / min of ucp restore's peak RSS across the sizes",
        }
    ]
