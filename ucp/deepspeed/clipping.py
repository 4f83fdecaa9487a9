"""The gradient clipping a written checkpoint carries: the source's, else DeepSpeed's default by the version that
ran it (``ucp.deepspeed.states`` builds the files around it)."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ucp.model.options import Decided

__all__ = ["CLIPPING_BY_DEFAULT_SINCE", "default_clipping", "clip_grad", "unknown_clipping_note"]

logger = logging.getLogger(__name__)

#: DeepSpeed clips gradients at 1.0 when the config does not say from 0.19.3 on (deepspeedai/DeepSpeed#8068,
#: ``GRADIENT_CLIPPING_DEFAULT``); earlier versions did not clip
CLIPPING_BY_DEFAULT_SINCE = (0, 19, 3)


def default_clipping(ds_version: str | None) -> float:
    """The gradient clipping a run had whose config left ``gradient_clipping`` out, by the DeepSpeed version
    that ran it (an unknown version: today's default)."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", ds_version or "")
    if found is None:
        return 1.0
    return 1.0 if tuple(int(x) for x in found.groups()) >= CLIPPING_BY_DEFAULT_SINCE else 0.0


def clip_grad(extras: Mapping[str, Any], ds_config: Mapping[str, Any], ds_version: str | None) -> float:
    """The source run's gradient clipping, which DeepSpeed's ZeRO-1/2 loader takes from the optim file over
    its own config: what ZeRO-1/2 recorded; else (ZeRO-3 records none) the config's, or the default of the
    DeepSpeed version that ran it. Writing 0.0 there would switch clipping off in the resumed run."""
    value = extras.get("clip_grad")
    if value is None:
        value = ds_config.get("gradient_clipping", default_clipping(ds_version))
    try:
        return float(value)
    except (TypeError, ValueError):
        return 0.0


def unknown_clipping_note(decided: Decided) -> str | None:
    """A DCP source records no clipping; the ZeRO-1/2 files then say DeepSpeed 0.19's default, which its load takes
    over the new run's config."""
    if decided.options.stage not in (1, 2) or decided.facts.info.format != "dcp":
        return None
    return (
        "the source records no gradient clipping: the ZeRO-1/2 files say 1.0 (DeepSpeed 0.19's default), which "
        "DeepSpeed's load takes over the new run's gradient_clipping"
    )
