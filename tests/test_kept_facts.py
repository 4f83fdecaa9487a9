"""The fast tier's check of what sources read and what plans decide, on the small real checkpoints tests/data keeps.

Every kept checkpoint (tests/data/golden: real DeepSpeed ZeRO-1/2/3 and AutoTP runs of the harness; tests/data/older:
real saves of DeepSpeed 0.14.5, 0.16.9 and 0.17.6; tests/data/gpu-written.tgz: real saves of an H200) is opened by the
format registry, and its facts (format, flavour, groups, parameters, steps, notes) and the native plans of a set of
restores (DP, stage, dtype, step policy; each plan's choices, ZeRO-3 sub-groups and notes, or its refusal) are held
to ``tests/data/kept_facts.json``. A change to a source's facts or a planner's decisions shows here in seconds,
without a training run; what the files then hold is tests/test_golden.py's, what a run does with them the real-run
tier's.

Regenerate (only when a change of facts or plans is intended, and say so in the commit):
``python -m tests.test_kept_facts --write``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from ucp.errors import UcpError
from ucp.model.options import RestoreOptions
from ucp.sources import open_reader
from ucp.targets.native import plan_native

DATA = Path(__file__).resolve().parent / "data"
EXPECTED = DATA / "kept_facts.json"

#: the restores planned for every kept checkpoint: (name, options)
PLANS: dict[str, dict[str, Any]] = {
    "same-dp-own-stage": {},
    "dp1-z3": {"dp": 1, "stage": 3},
    "dp3-z2": {"dp": 3, "stage": 2},
    "dp2-z1-fp16": {"dp": 2, "stage": 1, "dtype": "fp16"},
    "dp2-stage0": {"dp": 2, "stage": 0},
    "dp4-z3-sub100-reset": {"dp": 4, "stage": 3, "sub_group_size": 100, "step": "reset"},
    "dp2-z2-tp2": {"dp": 2, "stage": 2, "tp": 2},
}


def _kept() -> dict[str, Path]:
    """Every kept checkpoint, by a stable name."""
    from tests.support.gpu_written import gpu_written_root

    found: dict[str, Path] = {}
    for case in sorted((DATA / "golden").iterdir()):
        if case.is_dir():
            found[f"golden/{case.name}"] = case
    for release in sorted((DATA / "older").iterdir()):
        for case in sorted(release.iterdir()):
            found[f"older/{release.name}/{case.name}"] = case / "ckpt"
    root = gpu_written_root()
    for case in sorted(p for p in root.rglob("ckpt") if p.is_dir()):
        found[f"gpu/{case.parent.relative_to(root)}"] = case
    return found


def _facts(path: Path) -> dict[str, Any]:
    """What the registry reads of a kept checkpoint, or the one line that refuses it (a save ucp cannot move)."""
    try:
        reader = open_reader(path, verify=False)
    except UcpError as err:
        return {"refused": str(err).replace(str(path), "<ckpt>")}
    with reader:
        facts = reader.facts
        return {
            "format": reader.format,
            "stage": facts.info.zero_stage,
            "dp": facts.info.dp_world_size,
            "mp": facts.info.mp_world_size,
            "dtype": facts.info.dtype,
            "flavour": facts.flavour,
            "step": facts.step,
            "counters": [facts.info.global_steps, facts.info.skipped_steps],
            "groups": [
                {"params": g.params, "state_keys": list(g.state_keys), "step": g.step, "hyper": g.hyper.to_json()}
                for g in facts.groups
            ],
            "params": [[p.name, list(p.shape), p.dtype, p.group, p.frozen] for p in facts.params],
            "tied": dict(facts.tied),
            "buffers": list(facts.buffer_names),
            "notes": list(facts.warnings),
            "layout": facts.layout.kind if facts.layout is not None else None,
            "plans": {name: _plan(facts, fields) for name, fields in PLANS.items()},
        }


def _plan(facts: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """A restore's plan as data, or the one line that refuses it."""
    options = {"dp": facts.info.dp_world_size, "stage": facts.info.zero_stage, **fields}
    try:
        plan = plan_native(facts, RestoreOptions(**options))
    except UcpError as err:
        return {"refused": str(err)}
    return {
        "stage": plan.stage,
        "dp": plan.dp,
        "tp": plan.tp,
        "flavour": plan.flavour.name,
        "dtype": plan.dtype,
        "tag": plan.tag,
        "step": plan.step,
        "reset": plan.reset_moments,
        "offload": plan.offload,
        "round_robin": plan.round_robin,
        "transposed": plan.transposed,
        "sub_groups": list(plan.layout.sub_group_numel) if plan.layout is not None else None,
        "notes": list(plan.notes),
    }


def _expected() -> dict[str, Any]:
    """The recorded facts (none before the first --write: then the test below fails, naming every checkpoint)."""
    return json.loads(EXPECTED.read_text()) if EXPECTED.exists() else {}


@pytest.mark.parametrize("name", sorted(_expected()))
def test_a_kept_checkpoints_facts_and_plans_are_what_they_were(name: str) -> None:
    kept = _kept()
    assert name in kept, f"{name} is no longer kept in tests/data"
    got, want = _facts(kept[name]), _expected()[name]
    for key in want:
        assert got[key] == want[key], (name, key)


def test_every_kept_checkpoint_is_held_here() -> None:
    assert sorted(_kept()) == sorted(_expected())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the facts and plans of today's code")
    args = parser.parse_args(argv)
    if not args.write:
        parser.error("nothing to do: pass --write to regenerate tests/data/kept_facts.json")
    found = {name: _facts(path) for name, path in _kept().items()}
    EXPECTED.write_text(json.dumps(found, indent=1, sort_keys=True) + "\n")
    print(f"wrote {EXPECTED} ({len(found)} checkpoints)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
