"""torch.compile's wrapper in parameter names.

``torch.compile(module)`` returns an ``OptimizedModule`` that holds the module as ``_orig_mod``, so a model
compiled before ``deepspeed.initialize`` saves every name under it (``_orig_mod.embed.weight``; a block replaced
by its compiled wrapper: ``blocks.0._orig_mod.weight``). The same model not compiled, or compiled in place
(``module.compile()``, what DeepSpeed's ``engine.compile()`` and Hugging Face Trainer do), names them without it.
Pure functions: which names differ only by the wrapper, and how one side's names become the other's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ucp.model.options import Decided

__all__ = ["compiled_names_note", "WRAPPER_PATTERN", "has_wrapper", "without_wrapper", "wrapper_renames"]

#: a ``_orig_mod.`` name segment (``re.sub`` with ``\1`` removes it)
WRAPPER_PATTERN = r"(^|\.)_orig_mod\."
_SEGMENT = re.compile(WRAPPER_PATTERN)


def without_wrapper(name: str) -> str:
    """``name`` as an uncompiled model has it."""
    return _SEGMENT.sub(r"\1", name)


def has_wrapper(names: Iterable[str]) -> bool:
    return any(_SEGMENT.search(n) for n in names)


def wrapper_renames(saved: Iterable[str], live: Iterable[str]) -> dict[str, str]:
    """Saved name -> live name, for the saved names that differ from a live one only by the wrapper; empty
    unless every saved name has exactly one live counterpart (the names match already, or differ in more than
    the wrapper: the caller's own name check speaks then). Live names without a saved one are left alone."""
    by_plain: dict[str, list[str]] = {}
    for name in set(live):
        by_plain.setdefault(without_wrapper(name), []).append(name)
    renames: dict[str, str] = {}
    for name in set(saved):
        found = by_plain.get(without_wrapper(name), [])
        if len(found) != 1:
            return {}
        if found[0] != name:
            renames[name] = found[0]
    if len(set(renames.values())) != len(renames):
        return {}
    return renames


def compiled_names_note(decided: Decided) -> str | None:
    """Names under torch.compile's wrapper load only into a run compiled the same way: how to rename them."""
    if not has_wrapper(m.name for m in decided.facts.params):
        return None
    return (
        "the names carry torch.compile's _orig_mod. wrapper (the source compiled its model before "
        "deepspeed.initialize): a run that does so too loads these files; for one that does not, rename them "
        "in a migration (rename: {pattern: '(^|\\.)_orig_mod\\.', replace: '\\1'}), or restore live with "
        "ucp.restore(engine, ...), which matches them itself"
    )
