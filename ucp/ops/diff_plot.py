"""``ucp diff A B --plot FILE``: where two checkpoints differ, as one chart.

One column per common parameter (A's order) and one marker per state key (the fp32 master, each
optimizer state key, scalars): its max absolute difference on a log scale, so a single diverged
parameter among hundreds stands out. Values equal bit for bit sit on a floor line below the
smallest difference; differences the scale cannot show (shapes, state keys on one side only, NaNs
in different places, steps) are red crosses at the top. matplotlib is optional (``pip install 'ucp-checkpoint[plot]'``):
:func:`check_plot` says so before any work, and the chart is drawn with the Agg canvas, never pyplot.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ucp.errors import ConfigError, OutputExistsError, UcpError, WriteError
from ucp.io.atomic import PARTIAL_MARK, publish_new
from ucp.ops.diff import DiffReport, ParamDiff

__all__ = ["PLOT_SUFFIXES", "check_plot", "plot_report"]

#: the file kinds the chart can be written as (matplotlib picks the format from the suffix)
PLOT_SUFFIXES = (".png", ".svg", ".pdf")
_MARKERS = "o^sDvP*<>hX"
_INCH_PER_LABEL = 0.11  # a 6-point name, rotated, in its own column
_MAX_WIDTH = 80.0  # inches; beyond that every k-th name is labelled
_CHARS_PER_INCH = 11  # of the 9-point title, with the legend's column kept free


def check_plot(out: str | os.PathLike[str]) -> None:
    """Refuse, before anything is read, a chart that cannot be written: a suffix matplotlib would not
    write as a chart we support, or no matplotlib at all."""
    suffix = Path(out).suffix.lower()
    if suffix not in PLOT_SUFFIXES:
        raise ConfigError(
            f"--plot {out}: the chart is written as {', '.join(PLOT_SUFFIXES)}; name a file ending in one"
        )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UcpError(
            "--plot needs matplotlib: pip install matplotlib (or pip install 'ucp-checkpoint[plot]')"
        ) from None


def plot_report(report: DiffReport, out: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Draw ``report`` into ``out`` (.png, .svg or .pdf); returns the path. The file appears whole or
    not at all: it is drawn beside ``out`` under a partial name, then renamed into place."""
    check_plot(out)
    out = Path(out).absolute()
    if out.is_dir():
        raise OutputExistsError(f"--plot {out} is a folder; name the chart's file")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise WriteError(f"cannot create {out.parent}: {err.strerror}") from None
    figure = _figure(report)
    staged = out.parent / f".{out.name}{PARTIAL_MARK}{secrets.token_hex(4)}-{os.getpid()}"
    try:
        figure.savefig(staged, format=out.suffix.lower()[1:], dpi=100)
        with open(staged, "rb") as handle:
            os.fsync(handle.fileno())
        if overwrite:
            os.replace(staged, out)
        else:  # never over a file that appeared meanwhile
            publish_new(staged, out)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    return out


def _figure(report: DiffReport) -> Any:
    """The chart as a matplotlib Figure on an Agg canvas (no pyplot: no global state, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    params = report.params
    keys = _keys(params)
    values = [t.max_abs for p in params for t in p.tensors if t.max_abs > 0 and math.isfinite(t.max_abs)]
    floor, top = _limits(values, report.atol)
    width = min(max(8.0, 2.0 + _INCH_PER_LABEL * len(params)), _MAX_WIDTH)
    figure = Figure(figsize=(width, 6.5), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    ax.set_yscale("log")
    step = 0.8 / max(1, len(keys))
    for k, key in enumerate(keys):
        xs, ys = [], []
        for i, p in enumerate(params):
            for t in p.tensors:
                if t.key == key:
                    xs.append(i + (k - (len(keys) - 1) / 2) * step)
                    ys.append(min(max(t.max_abs, floor), top) if not math.isnan(t.max_abs) else top)
        ax.plot(xs, ys, _MARKERS[k % len(_MARKERS)], markersize=4, alpha=0.8, label=key, linestyle="none")
    broken = [i for i, p in enumerate(params) if _structural(p)]
    if broken:
        ax.plot(broken, [top] * len(broken), "x", color="red", markersize=8, label="shape, keys, step or NaNs differ")
    ax.axhline(floor, color="grey", linestyle=":", linewidth=1, label="0 (equal bit for bit)")
    if report.atol > 0:
        ax.axhline(report.atol, color="black", linestyle="--", linewidth=1, label=f"atol {report.atol:g}")
    ax.set_ylim(floor / 3, top * 3)
    ax.set_xlim(-1, max(1, len(params)))
    _label_params(ax, [p.name for p in params], width)
    ax.set_ylabel("max |A - B| per parameter and state key")
    ax.grid(axis="y", which="major", alpha=0.3)
    if width > 16:  # a wide chart is scrolled: the scale on both sides
        ax.tick_params(axis="y", which="both", right=True, labelright=True)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    room = int(width * _CHARS_PER_INCH)
    lines = [f"A: {report.a}", f"B: {report.b}", *_summary(report)]
    ax.set_title("\n".join(_elide(line, room) for line in lines), fontsize=9, loc="left")
    return figure


def _keys(params: Sequence[ParamDiff]) -> list[str]:
    """Every state key met, in the order first met (fp32 first)."""
    seen: dict[str, None] = {}
    for p in params:
        for t in p.tensors:
            seen.setdefault(t.key)
    return list(seen)


def _limits(values: Sequence[float], atol: float) -> tuple[float, float]:
    """(floor where zeros are drawn, top where structural differences are drawn): a decade below and
    above everything shown."""
    shown = [*values, *([atol] if atol > 0 else [])]
    if not shown:
        return 1e-12, 1.0
    floor = 10.0 ** (math.floor(math.log10(min(shown))) - 1)
    top = 10.0 ** (math.ceil(math.log10(max(shown))) + 1)
    return floor, top


def _structural(p: ParamDiff) -> bool:
    """A difference no magnitude shows: shapes, state keys on one side only, steps, NaNs in other places."""
    keys = bool(p.keys_only_a or p.keys_only_b)
    return p.shape is not None or keys or p.steps is not None or any(t.nan_mismatch for t in p.tensors)


def _label_params(ax: Any, names: Sequence[str], width: float) -> None:
    """Parameter names under their columns, every one while they fit, else every k-th."""
    fit = max(1, int((width - 2.0) / _INCH_PER_LABEL))
    every = max(1, math.ceil(len(names) / fit))
    ticks = list(range(0, len(names), every))
    ax.set_xticks(ticks)
    ax.set_xticklabels([names[i] for i in ticks], rotation=90, fontsize=6)
    ax.set_xlabel("parameter (A's order)" + (f", one in {every} named" if every > 1 else ""))


def _summary(report: DiffReport) -> list[str]:
    """The verdict and counts, as the title's last lines."""
    verdict = "equal" if report.equal else "differ"
    tol = f"atol {report.atol:g}" if report.atol else "bit for bit"
    parts = [f"{verdict} ({tol}): {len(report.params)} parameters compared, {len(report.differing)} differ"]
    if report.only_a or report.only_b:
        parts.append(f"only in A: {len(report.only_a)}, only in B: {len(report.only_b)}")
    if report.groups or report.counters:
        parts.append(f"{len(report.groups)} group settings and {len(report.counters)} counters differ")
    return ["; ".join(parts)]


def _elide(text: str, room: int) -> str:
    """``text`` cut in the middle to ``room`` characters (a long path keeps its start and its end)."""
    if len(text) <= room:
        return text
    half = max(1, (room - 3) // 2)
    return text[:half] + "..." + text[-half:]
