"""Rename, drop and reset parameters on their way from a source to a target.

A migration's transforms become one :class:`TransformedReader` around the source reader, so the
universal writer, the native writer and the exporters consume a transformed checkpoint exactly as
they would an untouched one.

Call order: :func:`plan_transforms` turns the source's :class:`~ucp.model.records.Facts` and a list of
steps into a :class:`TransformPlan` (pure data: every rename, drop and reset, the new facts, and
the problems found, nothing read from disk beyond the facts); the caller checks
``plan.problems``; only then :class:`TransformedReader` wraps the source reader with the plan.

Semantics, applied in order, each step seeing the names the previous steps left:

* ``Rename(pattern, replace)``: ``re.sub`` on every parameter, tied alias and buffer name.
  Two names becoming one, or a name becoming empty, is a problem.
* ``Drop(patterns)``: names that any pattern finds (``re.search``) go, with their tensors and
  optimizer state. A dropped parameter takes its tied aliases with it; dropping only an alias
  keeps the parameter that holds the data. A param group left empty is removed and the rest are
  renumbered (the new optimizer must not have that group either).
* ``ResetOptimizer(patterns, keep_step=False)``: matching parameters keep their weights; their Adam
  moments become zeros and their step 0, as if they had just been created (``keep_step``: the step
  stays, a warm start that every layout can hold). A pattern that finds only a tied alias resets
  the parameter that holds the data (they share one optimizer state). The universal format holds a
  step per parameter; DeepSpeed holds one per flat partition, so a native target refuses
  (``ucp.migrate`` says so before writing) when restarted and kept parameters share one, unless its
  ``step`` is fixed: an integer keeps that step with zero moments, ``reset`` restarts everything.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from ucp.errors import InputError
from ucp.model import flavours
from ucp.model.records import Facts, Forwarding, GroupMeta, ParamMeta, ParamState, Reader

__all__ = [
    "Rename",
    "RenameTable",
    "Drop",
    "ResetOptimizer",
    "Step",
    "Problem",
    "TransformPlan",
    "plan_transforms",
    "TransformedReader",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Rename:
    """``re.sub(pattern, replace, name)`` on every name (back-references such as ``\\1`` work)."""

    pattern: str
    replace: str


@dataclass(frozen=True)
class Drop:
    """Remove every parameter, tied alias and buffer that one of ``patterns`` finds."""

    patterns: tuple[str, ...]


@dataclass(frozen=True)
class ResetOptimizer:
    """Zero the moments (and the step, unless ``keep_step``) of every parameter one of ``patterns`` finds."""

    patterns: tuple[str, ...]
    keep_step: bool = False


@dataclass(frozen=True)
class RenameTable:
    """Each name the table holds becomes its value (names matched across torch.compile's wrapper); not a
    migration YAML step: ucp builds it from the names a live model has."""

    table: Mapping[str, str]


Step = Rename | RenameTable | Drop | ResetOptimizer


@dataclass(frozen=True)
class Problem:
    """Something that makes a step impossible; ``step`` indexes the list, ``where`` a field in it.

    ``where`` is ``()`` for the step itself, ``("pattern",)`` / ``("replace",)`` for a rename,
    ``(j,)`` for the j-th pattern of a drop or reset.
    """

    step: int
    where: tuple[str | int, ...]
    message: str


@dataclass
class TransformPlan:
    """What the steps do to one checkpoint; ``facts`` is the checkpoint a target will see."""

    facts: Facts
    origin: dict[str, str]  # new parameter name -> the source's name
    renames: list[tuple[int, str, str]] = field(default_factory=list)  # (step, old, new) as that step saw them
    drops: list[tuple[int, str, str, str]] = field(default_factory=list)  # (step, name, param|alias|buffer, why)
    resets: list[tuple[int, str, bool]] = field(default_factory=list)  # (step, name then, step restarts at 0)
    reset_params: dict[str, int] = field(default_factory=dict)  # final name -> the step that reset it
    restarted: set[str] = field(default_factory=set)  # final names whose step becomes 0 (a subset of the above)
    removed_groups: list[int] = field(default_factory=list)  # source param-group indices left empty
    buffer_origin: dict[str, str] = field(default_factory=dict)  # new buffer name -> the source's name
    warnings: list[tuple[int, tuple[str | int, ...], str]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    @property
    def changes_anything(self) -> bool:
        return bool(self.renames or self.drops or self.reset_params)


@dataclass
class _Name:
    """A name as the steps see it: where it came from, what it is now, and what kind it is."""

    source: str
    now: str
    kind: str  # param | alias | buffer | dropped
    owner: _Name | None = None  # for aliases: the parameter holding the data
    meta: ParamMeta | None = None
    reset_by: int | None = None  # index of the step that reset its optimizer state
    restart: bool = False  # its step becomes 0 too


def _compile(pattern: str) -> re.Pattern[str] | str:
    try:
        return re.compile(pattern)
    except re.error as err:
        return f"{pattern!r} is not a valid regular expression: {err}"


def plan_transforms(facts: Facts, steps: list[Step]) -> TransformPlan:
    """Apply ``steps`` to the names in ``facts``; nothing is read. Problems are collected, not raised."""
    names: list[_Name] = []
    by_source: dict[str, _Name] = {}
    for meta in facts.params:
        entry = _Name(meta.name, meta.name, "param", meta=meta)
        names.append(entry)
        by_source[meta.name] = entry
    for alias, owner in facts.tied.items():
        names.append(_Name(alias, alias, "alias", owner=by_source.get(owner)))
    names += [_Name(b, b, "buffer") for b in facts.buffer_names]

    plan = TransformPlan(facts=facts, origin={})
    for index, step in enumerate(steps):
        alive = [n for n in names if n.kind != "dropped"]
        if isinstance(step, Rename):
            regex = _compile(step.pattern)
            if isinstance(regex, str):
                plan.problems.append(Problem(index, ("pattern",), regex))
                break
            _rename(index, partial(regex.sub, step.replace), repr(step.pattern), alive, plan)
        elif isinstance(step, RenameTable):
            _rename(index, partial(_looked_up, step.table), "the table", alive, plan)
        elif isinstance(step, Drop):
            _drop(index, step, alive, plan)
        elif isinstance(step, ResetOptimizer):
            _reset(index, step, alive, plan)
        else:  # a programming error, not a user's
            raise TypeError(f"unknown transform step {step!r}")
        if plan.problems:
            break  # later steps would see names the user did not mean
    if not plan.problems:
        plan.facts = _new_facts(facts, names, plan)
    return plan


def _looked_up(table: Mapping[str, str], name: str) -> str:
    return table.get(name, name)


def _rename(index: int, how: Callable[[str], str], what: str, alive: list[_Name], plan: TransformPlan) -> None:
    """Rename every alive name by ``how`` (``what`` names the rule in a warning)."""
    new: dict[int, str] = {}
    for i, entry in enumerate(alive):
        try:
            new[i] = how(entry.now)
        except (re.error, IndexError) as err:
            plan.problems.append(Problem(index, ("replace",), f"cannot be applied to {entry.now!r}: {err}"))
            return
    changed = [(entry, new[i]) for i, entry in enumerate(alive) if new[i] != entry.now]
    if not changed:
        plan.warnings.append((index, ("pattern",), f"{what} renames nothing"))
        return
    for entry, name in changed:
        if not name:
            plan.problems.append(Problem(index, (), f"renames {entry.now!r} to an empty name"))
    seen: dict[str, list[_Name]] = {}
    for i, entry in enumerate(alive):
        seen.setdefault(new[i], []).append(entry)
    for name, entries in seen.items():
        if len(entries) > 1:
            olds = ", ".join(repr(e.now) for e in entries[:-1]) + f" and {entries[-1].now!r}"
            both = "both" if len(entries) == 2 else "all"
            plan.problems.append(
                Problem(
                    index,
                    (),
                    f"{olds} would {both} be named {name!r}; a checkpoint cannot hold two tensors under one name",
                )
            )
    if plan.problems:
        return
    for entry, name in changed:
        plan.renames.append((index, entry.now, name))
        entry.now = name


def _drop(index: int, step: Drop, alive: list[_Name], plan: TransformPlan) -> None:
    for j, pattern in enumerate(step.patterns):
        regex = _compile(pattern)
        if isinstance(regex, str):
            plan.problems.append(Problem(index, (j,), regex))
            continue
        hits = [e for e in alive if e.kind != "dropped" and regex.search(e.now)]
        if not hits:
            plan.warnings.append((index, (j,), f"{pattern!r} drops nothing"))
        for entry in hits:
            plan.drops.append((index, entry.now, entry.kind, f"matches {pattern!r}"))
            was = entry.kind
            entry.kind = "dropped"
            if was == "param":
                for alias in alive:
                    if alias.kind == "alias" and alias.owner is entry:
                        plan.drops.append((index, alias.now, "alias", f"tied to dropped {entry.now!r}"))
                        alias.kind = "dropped"
    if plan.problems:
        return
    if not any(e.kind == "param" for e in alive):
        plan.problems.append(Problem(index, (), "drops every parameter; nothing would be left to write"))


def _reset(index: int, step: ResetOptimizer, alive: list[_Name], plan: TransformPlan) -> None:
    for j, pattern in enumerate(step.patterns):
        regex = _compile(pattern)
        if isinstance(regex, str):
            plan.problems.append(Problem(index, (j,), regex))
            continue
        targets: list[_Name] = []
        for entry in alive:
            if not regex.search(entry.now):
                continue
            if entry.kind == "param":
                targets.append(entry)
            elif entry.kind == "alias" and entry.owner is not None and entry.owner.kind == "param":
                plan.warnings.append(
                    (
                        index,
                        (j,),
                        f"{entry.now!r} is tied to {entry.owner.now!r}; they share one "
                        f"optimizer state, so {entry.owner.now!r} is reset",
                    )
                )
                targets.append(entry.owner)
        if not targets:
            plan.warnings.append((index, (j,), f"{pattern!r} matches no parameter; nothing is reset"))
        for entry in targets:
            if entry.meta is not None and entry.meta.frozen:
                plan.warnings.append((index, (j,), f"{entry.now!r} is frozen and has no optimizer state to reset"))
            elif entry.reset_by is None:
                entry.reset_by, entry.restart = index, not step.keep_step
                plan.resets.append((index, entry.now, entry.restart))
            elif not step.keep_step and not entry.restart:  # reset again, this time with the step
                entry.restart = True
                plan.resets.append((index, entry.now, True))


def _new_facts(facts: Facts, names: list[_Name], plan: TransformPlan) -> Facts:
    params = [n for n in names if n.kind == "param"]
    now_of = {n.source: n.now for n in params}
    reset = {n.now: n.reset_by for n in params if n.reset_by is not None}
    restarted = {n.now for n in params if n.restart}
    step_of_new: dict[int, int] = {}
    groups: list[GroupMeta] = []
    for group in facts.groups:
        members = [now_of[p] for p in group.params if p in now_of]
        if not members:
            plan.removed_groups.append(group.index)
            continue
        step_of_new[group.index] = len(groups)
        kept = [m for m in members if m not in restarted]
        # a group's step is the largest of its members'; restarted members are at 0
        step = group.step if kept else (0 if group.step is not None else None)
        groups.append(replace(group, index=len(groups), params=members, step=step, raw=dict(group.raw)))
    metas = [
        replace(n.meta, name=n.now, group=None if n.meta.group is None else step_of_new[n.meta.group])
        for n in params
        if n.meta is not None
    ]
    tied = {n.now: n.owner.now if n.owner is not None else facts.tied[n.source] for n in names if n.kind == "alias"}
    buffers = [n for n in names if n.kind == "buffer"]
    plan.origin = {n.now: n.source for n in params}
    plan.buffer_origin = {n.now: n.source for n in buffers}
    plan.reset_params = reset
    plan.restarted = restarted
    group_steps = [g.step for g in groups if g.step is not None]
    return replace(
        facts,
        groups=groups,
        params=metas,
        tied=tied,
        buffer_names=[n.now for n in buffers],
        step=max(group_steps) if group_steps else (None if facts.step is None else 0),
        warnings=list(facts.warnings),
        tp_rules={new: facts.tp_rules[old] for new, old in plan.origin.items() if old in facts.tp_rules},
    )


class TransformedReader(Forwarding):
    """A :class:`~ucp.model.records.Reader` showing ``inner`` as the plan's steps leave it.

    Call order as for any reader; ``close`` closes ``inner``. Reads are stateless (thread-safe as
    far as ``inner`` is).
    """

    def __init__(self, inner: Reader, plan: TransformPlan) -> None:
        if plan.problems:
            raise InputError("; ".join(p.message for p in plan.problems))
        if plan.reset_params:
            flavours.check_reset(inner.facts.flavour)
        self.inner = inner
        self.plan = plan
        self.facts = plan.facts

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        source = self.plan.origin.get(name)
        if source is None:
            raise InputError(f"parameter {name!r} is not in the transformed checkpoint")
        state = self.inner.read(source, moments=moments)
        if name not in self.plan.reset_params:
            return state
        return ParamState(
            fp32=state.fp32,
            optim={k: torch.zeros_like(v) for k, v in state.optim.items()},
            step=0 if name in self.plan.restarted and state.step is not None else state.step,
            scalars={k: torch.full_like(v, self._scalar_reset(name, k)) for k, v in state.scalars.items()},
        )

    def _scalar_reset(self, name: str, key: str) -> float:
        """A scalar's value in a fresh optimizer (NAdam's mu_product starts at 1, ASGD's eta at the group's lr),
        from the flavour."""
        facts = self.inner.facts
        flavour = flavours.FLAVOURS.get(facts.flavour or "")
        start = flavour.scalars.get(key) if flavour is not None else None
        if isinstance(start, str):
            group = facts.param(self.plan.origin.get(name, name)).group
            start = facts.groups[group].raw.get(start) if group is not None else None
        if not isinstance(start, (int, float)) or isinstance(start, bool):
            raise InputError(f"{name}: cannot reset optimizer scalar {key!r}: ucp does not know its starting value")
        return float(start)

    def param_steps(self) -> dict[str, int | None]:
        """The inner reader's steps under the new names; a parameter whose reset restarts it at step 0."""
        inner = self.inner.param_steps()
        steps = {new: inner.get(old) for new, old in self.plan.origin.items()}
        for name in self.plan.restarted:
            if steps.get(name) is not None:
                steps[name] = 0
        return steps

    def buffers(self) -> dict[str, torch.Tensor]:
        source = self.inner.buffers()
        return {new: source[old] for new, old in self.plan.buffer_origin.items() if old in source}

    def extras(self) -> dict[str, Any]:
        return self.inner.extras()

    def close(self) -> None:
        self.inner.close()
