"""``ucp diff A B``: two checkpoints of any format ucp reads, compared parameter by parameter.

For the questions users bring to a resume that "looks like training from scratch" or has stale
moments: do these two checkpoints hold the same weights, the same optimizer state under the same
keys, the same steps and the same group settings, whatever their DP size, TP degree or format?
Both sides are read a few parameters at a time in a thread pool (a progress bar on stderr), each state as
pieces of its files compared a 16 MiB chunk at a time (memory near ``2 x workers`` chunks, whatever the largest
tensor), so a ZeRO-3 checkpoint at DP=4 and its universal directory or a restore at DP=2 compare equal. Tensors equal bit for bit (the common case) take one pass over their
bytes; only those that differ are measured.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ucp.io.memory import give_back_freed
from ucp.io.pool import default_workers, parallel_map, state_bytes
from ucp.io.timing import phase
from ucp.model.pieces import Pieces
from ucp.model.records import Facts, PieceState, Reader
from ucp.sources import open_reader
from ucp.transforms.megatron_llama import MegatronAsLlama

__all__ = ["TensorDiff", "ParamDiff", "DiffReport", "diff", "diff_readers"]

#: group settings compared (neutral form): what changes a resumed run's updates
_HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad")


@dataclass(frozen=True)
class TensorDiff:
    """How far one tensor of B is from A's: max absolute and max relative difference (NaN-aware)."""

    key: str  # "fp32" or an optimizer state key
    max_abs: float
    max_rel: float
    nan_mismatch: bool = False

    def within(self, atol: float) -> bool:
        return not self.nan_mismatch and self.max_abs <= atol


@dataclass
class ParamDiff:
    """One parameter held by both sides: what differs."""

    name: str
    shape: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # (A, B) when the shapes differ
    tensors: list[TensorDiff] = field(default_factory=list)
    keys_only_a: list[str] = field(default_factory=list)
    keys_only_b: list[str] = field(default_factory=list)
    steps: tuple[int | None, int | None] | None = None  # (A, B) when they differ

    def equal(self, atol: float) -> bool:
        return (
            self.shape is None
            and not self.keys_only_a
            and not self.keys_only_b
            and self.steps is None
            and all(t.within(atol) for t in self.tensors)
        )


@dataclass
class DiffReport:
    """Everything :func:`diff` found; ``equal`` decides the exit code of ``ucp diff``."""

    a: str
    b: str
    atol: float
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    params: list[ParamDiff] = field(default_factory=list)  # every common parameter, in A's order
    groups: list[str] = field(default_factory=list)  # one line per group setting that differs
    counters: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # engine counters that differ

    @property
    def differing(self) -> list[ParamDiff]:
        return [p for p in self.params if not p.equal(self.atol)]

    @property
    def equal(self) -> bool:
        return not (self.only_a or self.only_b or self.differing or self.groups or self.counters)

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "atol": self.atol,
            "equal": self.equal,
            "params_compared": len(self.params),
            "only_a": self.only_a,
            "only_b": self.only_b,
            "differing": [_jsonable(asdict(p)) for p in self.differing],
            "groups": self.groups,
            "counters": {k: list(v) for k, v in self.counters.items()},
        }

    def lines(self, most: int = 20) -> Iterator[str]:
        """The text ``ucp diff`` prints: what differs, worst first, then one verdict line."""
        for name in self.only_a:
            yield f"only in A: {name}"
        for name in self.only_b:
            yield f"only in B: {name}"
        worst = sorted(self.differing, key=_badness, reverse=True)
        for p in worst[:most]:
            yield f"{p.name}: " + "; ".join(_param_text(p, self.atol))
        if len(worst) > most:
            yield f"... and {len(worst) - most} more parameters differ"
        yield from self.groups
        for key, (va, vb) in self.counters.items():
            yield f"{key}: {va} vs {vb}"
        verdict = "equal" if self.equal else "differ"
        tol = f" within atol={self.atol:g}" if self.atol else " bit for bit"
        yield f"{verdict}: {len(self.params)} parameters compared{tol if self.equal else ''}"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _badness(p: ParamDiff) -> float:
    if p.shape is not None or p.keys_only_a or p.keys_only_b:
        return math.inf
    return max((t.max_abs for t in p.tensors), default=0.0)


def _param_text(p: ParamDiff, atol: float) -> Iterator[str]:
    if p.shape is not None:
        yield f"shape {p.shape[0]} vs {p.shape[1]}"
    if p.keys_only_a:
        yield f"state only in A: {', '.join(p.keys_only_a)}"
    if p.keys_only_b:
        yield f"state only in B: {', '.join(p.keys_only_b)}"
    if p.steps is not None:
        yield f"step {p.steps[0]} vs {p.steps[1]}"
    for t in p.tensors:
        if not t.within(atol):
            nan = ", NaN in different places" if t.nan_mismatch else ""
            yield f"{t.key} max abs {t.max_abs:.3g}, max rel {t.max_rel:.3g}{nan}"


#: elements of a state compared at once (16 MiB of fp32 per side): a 4 GB embedding is never whole in memory
_CHUNK = 4 << 20


def _chunk_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, bool]:
    """(max abs, max rel, NaNs in different places) of two flat chunks of equal length."""
    if a.dtype == b.dtype and torch.equal(a, b):  # one pass; False wherever a NaN is
        return 0.0, 0.0, False
    a, b = a.detach().float(), b.detach().float()
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    nan_mismatch = bool((nan_a != nan_b).any())
    both = ~(nan_a | nan_b)
    a, b = a[both], b[both]
    if a.numel() == 0:
        return 0.0, 0.0, nan_mismatch
    same = a == b  # equal infinities too
    delta = torch.where(same, torch.zeros_like(a), (a - b).abs())
    scale = torch.maximum(a.abs(), b.abs())
    rel = torch.where(same, torch.zeros_like(a), delta / scale)
    return float(delta.max()), float(rel.max()), nan_mismatch


def _tensor_diff(key: str, a: Pieces, b: Pieces) -> TensorDiff:
    """:func:`_chunk_diff` folded over both states a bounded chunk at a time, into two buffers reused."""
    if a.numel != b.numel:
        return TensorDiff(key, math.inf, math.inf)
    size = min(_CHUNK, a.numel)
    buf_a, buf_b = torch.empty(size, dtype=a.dtype), torch.empty(size, dtype=b.dtype)
    max_abs = max_rel = 0.0
    nan_mismatch = False
    for start in range(0, a.numel, _CHUNK):
        end = min(start + _CHUNK, a.numel)
        ca, cb = buf_a[: end - start], buf_b[: end - start]
        a.slice(start, end).copy_to(ca)
        b.slice(start, end).copy_to(cb)
        d_abs, d_rel, d_nan = _chunk_diff(ca, cb)
        max_abs, max_rel, nan_mismatch = max(max_abs, d_abs), max(max_rel, d_rel), nan_mismatch or d_nan
    return TensorDiff(key, max_abs, max_rel, nan_mismatch)


def _compare_param(name: str, ra: Reader, rb: Reader) -> ParamDiff:
    """Both sides' state of ``name`` as pieces of their files, compared a chunk at a time."""
    with ExitStack() as stack:
        sa = stack.enter_context(ra.read_pieces(name))
        sb = stack.enter_context(rb.read_pieces(name))
        out = _compare_states(name, sa, sb)
    give_back_freed()  # the chunks' buffers, freed in this worker thread's heap
    return out


def _compare_states(name: str, sa: PieceState, sb: PieceState) -> ParamDiff:
    out = ParamDiff(name)
    if tuple(sa.fp32.shape) != tuple(sb.fp32.shape):
        out.shape = (tuple(sa.fp32.shape), tuple(sb.fp32.shape))
        return out
    out.tensors.append(_tensor_diff("fp32", sa.fp32, sb.fp32))
    out.keys_only_a = [k for k in sa.optim if k not in sb.optim]
    out.keys_only_b = [k for k in sb.optim if k not in sa.optim]
    for key in sa.optim:
        if key in sb.optim:
            out.tensors.append(_tensor_diff(key, sa.optim[key], sb.optim[key]))
    for key in sa.scalars:
        if key in sb.scalars:
            out.tensors.append(_tensor_diff(key, Pieces.of(sa.scalars[key]), Pieces.of(sb.scalars[key])))
    if sa.step != sb.step:
        out.steps = (sa.step, sb.step)
    return out


def _groups(fa: Facts, fb: Facts) -> list[str]:
    """Group settings that differ, matched by their members (groups may be numbered differently)."""
    lines = []
    of_b = {name: g for g in fb.groups for name in g.params}
    for ga in fa.groups:
        matched = {id(of_b[n]): of_b[n] for n in ga.params if n in of_b}
        for gb in matched.values():
            for key in _HYPER:
                va, vb = getattr(ga.hyper, key), getattr(gb.hyper, key)
                if va != vb:
                    lines.append(f"param group {ga.index} (B's {gb.index}): {key} {va} vs {vb}")
    return lines


def _counters(fa: Facts, fb: Facts) -> dict[str, tuple[Any, Any]]:
    """The run counters that differ; DeepSpeed's sample count only where both sides record one (a DCP or FSDP
    folder has no place for it)."""
    values = {k: (getattr(fa.info, k), getattr(fb.info, k)) for k in ("global_steps", "skipped_steps")}
    samples = fa.info.global_samples, fb.info.global_samples
    if None not in samples:
        values["global_samples"] = samples
    return {k: v for k, v in values.items() if v[0] != v[1]}


def diff_readers(
    ra: Reader, rb: Reader, *, atol: float = 0.0, a: str = "A", b: str = "B", workers: int | None = None
) -> DiffReport:
    """Compare two open readers; see :func:`diff`. A Megatron-Core checkpoint against any other is compared as the
    Llama it is (``ucp.transforms.megatron_llama``)."""
    if (ra.facts.megatron is None) != (rb.facts.megatron is None):
        ra, rb = (MegatronAsLlama(r) if r.facts.megatron is not None else r for r in (ra, rb))
    names_a = [m.name for m in ra.facts.params]
    names_b = {m.name for m in rb.facts.params}
    report = DiffReport(a, b, atol)
    report.only_a = [n for n in names_a if n not in names_b]
    report.only_b = sorted(names_b - set(names_a))
    common = [n for n in names_a if n in names_b]
    weigh = state_bytes(ra.facts)
    with phase("compare every parameter"):
        report.params = list(
            parallel_map(
                lambda n: _compare_param(n, ra, rb),
                common,
                workers or default_workers(),
                desc="diff",
                weight=lambda n: 2 * weigh(n),
            )
        )
    report.groups = _groups(ra.facts, rb.facts)
    report.counters = _counters(ra.facts, rb.facts)
    return report


def diff(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    atol: float = 0.0,
    tag_a: str | None = None,
    tag_b: str | None = None,
    workers: int | None = None,
) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (DeepSpeed ZeRO at any DP/TP, universal, DCP, Hugging Face folders).

    Args:
        a, b: the two checkpoints.
        atol: the largest absolute difference still counted as equal (0: bit for bit, NaNs in the same places).
        tag_a, tag_b: the DeepSpeed tag to read on each side (default: ``latest``).
        workers: parameters compared at once (default: the CPUs ucp may use, at most 8).

    Returns:
        A :class:`DiffReport`: names on one side only, every common parameter's differences (fp32
        master, each optimizer state key, scalars, step), group settings and engine counters that differ.

    Example::

        report = ucp.ops.diff.diff("ckpt_dp4", "restored_dp2")
        assert report.equal, "\\n".join(report.lines())
    """
    with ExitStack() as stack:
        ra = stack.enter_context(open_reader(a, tag=tag_a))
        rb = stack.enter_context(open_reader(b, tag=tag_b))
        return diff_readers(ra, rb, atol=atol, a=str(a), b=str(b), workers=workers)
