"""A cost model fitted to the scale series, and what it projects for checkpoints this machine cannot hold.

Per tool: ``seconds = fixed + per_gb * GB + per_ktensor * (tensors / 1000) + per_kfile * (files written / 1000)
+ per_krank * (source DP / 1000)``,
least squares over the series' points with every coefficient kept non-negative (a term that would fit negative
is dropped and the rest refitted). Projections apply it to a real model's ZeRO-3 bf16 Adam save, once with the
fitted per-GB cost (this machine: page-cached reads, 2 cores) and once with the bytes at a stated disk bandwidth.
numpy only, imported when fitting: the measuring process stays light.
"""

from __future__ import annotations

from typing import Any

from .shapes import PROJECTIONS, Projection

TERMS = ("fixed", "per_gb", "per_ktensor", "per_kfile", "per_krank")
FIT_TOOLS = ("to-universal", "restore", "reshard")
DISK_GBPS = 2.0  # stated bandwidth for the disk-bound projection: a data-centre NVMe copying (read + write)
# DeepSpeed's zero_to_fp32 with mmap (DeepSpeed PR #6658), weights only, no optimizer state: (label, seconds, peak GB)
ZERO_TO_FP32 = {"Llama-3-70B": (20 * 60 + 45, 159), "Llama-3-405B": (2 * 3600 + 9 * 60 + 59, 262)}


def _features(gb: float, tensors: int, files: int, dp: int) -> list[float]:
    return [1.0, gb, tensors / 1000, files / 1000, dp / 1000]


def fit(points: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Coefficients per tool from the ZeRO-3 points' medians (the worker series excluded: it changes the machine;
    the projections are ZeRO-3 saves, and ZeRO-1/2 files cost differently per rank)."""
    import numpy as np

    model: dict[str, dict[str, float]] = {}
    for tool in FIT_TOOLS:
        rows = [p for p in points if p["series"] != "workers" and p.get("stage", 3) == 3 and tool in p["tools"]]
        if len(rows) < len(TERMS):
            continue
        x = np.array([_features(p["bytes"] / 1e9, p["tensors"], p["tools"][tool]["files_out"], p["dp"]) for p in rows])
        y = np.array([p["tools"][tool]["wall_s"] for p in rows])
        active = list(range(len(TERMS)))
        while True:
            coef, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            if (coef >= 0).all() or len(active) == 1:
                break
            active = [a for a, c in zip(active, coef) if c >= 0]
        full = dict.fromkeys(TERMS, 0.0)
        full.update({TERMS[a]: float(max(c, 0.0)) for a, c in zip(active, coef)})
        predicted = x @ np.array([full[t] for t in TERMS])
        full["max_rel_error"] = float(np.max(np.abs(predicted - y) / y))
        model[tool] = full
    return model


def _files_out(tool: str, target: Projection) -> int:
    """Files a tool writes for ``target``: four per tensor (fp32, exp_avg, exp_avg_sq, step) for a universal
    folder, two per rank for a native one."""
    return 4 * target.tensors + 1 if tool == "to-universal" else 2 * target.dp + 1


def project(model: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """Each tool's projected seconds for each real model, fitted and disk-bound, beside zero_to_fp32's row."""
    rows = []
    for target in PROJECTIONS:
        gb = target.shard_bytes / 1e9
        name = target.label.split(",")[0]
        row: dict[str, Any] = {"model": target.label, "params": target.params, "tensors": target.tensors, "gb": gb}
        for tool, c in model.items():
            files = _files_out(tool, target)
            overhead = (
                c["fixed"]
                + c["per_ktensor"] * target.tensors / 1000
                + c["per_kfile"] * files / 1000
                + c["per_krank"] * target.dp / 1000
            )
            row[tool] = {"fitted_s": overhead + c["per_gb"] * gb, "disk_s": overhead + gb / DISK_GBPS}
        row["zero_to_fp32"] = ZERO_TO_FP32.get(name)
        rows.append(row)
    return rows
