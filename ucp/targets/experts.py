"""What the two expert targets share (a legacy MoE checkpoint, ``ucp.targets.moe``; an AutoEP one,
``ucp.targets.autoep``): the expert-parallel size a restore writes for, the one result line, and the refusal of
what neither writes.

A source with experts is always written by one of them (a dense-shaped checkpoint would put every expert on every
rank, under names its run lacks): without ``ep`` at the source's own expert-parallel size, and at the source's
ZeRO stage unless one is asked.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ucp.errors import ConfigError
from ucp.model.option_table import Option
from ucp.model.records import Facts, Reader
from ucp.targets.format import Request, TargetFormat, Written
from ucp.targets.native import NativePlan, native_written

__all__ = ["expert_format", "has_experts", "serves_experts"]

#: writes a reader for a run of ``dp`` ranks at ``ep``: (reader, out, options, ep=, overwrite=, workers=, fsync=)
ExpertWriter = Callable[..., NativePlan]


def has_experts(facts: Facts) -> bool:
    """The checkpoint holds expert param groups (``moe: True``): a legacy MoE or an AutoEP run."""
    return any(group.raw.get("moe") for group in facts.groups)


def _refusal(options: list[Option], request: Request) -> str:
    if request.has("ep"):
        return (
            "--ep writes a legacy MoE checkpoint at PP=1 in one process (or an AutoEP one): drop --pp and --distributed"
        )
    return f"the source is a mixture-of-experts run, which {options[0].flag} cannot write: restore without it (--ep)"


def expert_format(
    *,
    name: str,
    label: str,
    docs: str,
    noun: str,
    size: str,
    write: ExpertWriter,
    source_ep_size: Callable[[Reader], int],
    serves: Callable[[Reader, Request], bool],
) -> TargetFormat:
    """The TargetFormat of an expert target: ``noun`` (``a MoE``) and ``size`` (what DeepSpeed calls the expert-
    parallel size: ``ep_size``, ``autoep_size``) name it in its result line."""

    def _write(reader: Reader, out: Path, request: Request) -> Written:
        dp = int(request.get("dp"))
        ep = int(request.get("ep")) if request.has("ep") else source_ep_size(reader)
        if not request.has("ep") and dp % ep:
            raise ConfigError(f"the source's {size}={ep} does not divide --dp {dp}: give the new run's --ep")
        options = request.restore_options(reader.facts.info.zero_stage)
        plan = write(reader, out, options, ep=ep, overwrite=request.overwrite, workers=request.workers,
                     fsync=request.fsync)  # fmt: skip
        return native_written(plan, out, noun=noun, layout=f"dp={plan.dp} at {size}={ep}", format=name, ep=ep)

    return TargetFormat(name=name, label=label, docs=docs, write=_write, serves=serves, refusal=_refusal)


def serves_experts(autoep: Callable[[Reader], bool], wants: bool) -> Callable[[Reader, Request], bool]:
    """An expert target serves a source with experts, or one given ``--ep``: AutoEP's when ``autoep(reader)``."""
    return lambda reader, request: (request.has("ep") or has_experts(reader.facts)) and autoep(reader) == wants
