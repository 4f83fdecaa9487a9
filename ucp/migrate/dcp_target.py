"""A migration's ``target.format: dcp``: planned and described here, written by ucp.targets.dcp.

A DCP output has no layout to decide (DCP reshards on load), so planning only runs the writer's own
planner on the transformed facts, to refuse before anything is written what the writer would refuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ucp.errors import UcpError
from ucp.migrate.issues import Issue
from ucp.migrate.schema import TargetConfig
from ucp.model.options import parse_step
from ucp.model.records import Reader
from ucp.transforms import TransformPlan

__all__ = ["plan_dcp_target", "describe_dcp"]


def plan_dcp_target(
    target: TargetConfig, reader: Reader, tplan: TransformPlan, steps: Mapping[str, int], issues: list[Issue]
) -> Any:
    """The DcpPlan of the target (``steps``: each trained parameter's step after the transforms), or
    None with the reason added to ``issues``."""
    from ucp.targets.dcp import plan_dcp

    try:
        step = parse_step(target.step)
        return plan_dcp(
            tplan.facts,
            {},
            reader.extras(),
            target.optimizer,
            steps=steps,
            layout=target.layout or "torch",
            step=step if isinstance(step, int) else None,
            reset=step == "reset",
        )
    except UcpError as err:
        at = ("target", "optimizer") if "family" in str(err) or "optimizer" in str(err) else ("target",)
        issues.append(Issue(at, str(err)))
        return None


def describe_dcp(dcp: Any, target: TargetConfig, counts: str, steps: Mapping[str, int]) -> list[str]:
    """The dry-run lines of a dcp target: what the folder will hold, for which optimizer, at which steps."""
    top = [k for k in dcp.state if k in ("optim", "optimizer", "lr_scheduler", "train_state")]
    model = "model FQNs at the top level" if dcp.layout == "torchtitan" else "model"
    known = sorted(set(steps.values()))
    step = f"step {known[0]}" if len(known) == 1 else f"steps {known}"
    tensors = sum(1 for key in dcp.lazy if ".state." in key)
    return [
        f"write      {target.output}: torch.distributed.checkpoint folder ({dcp.layout} layout) for "
        f"{dcp.flavour}, fp32, any world size: {model}, {', '.join(top)}",
        f"             {counts}; {tensors} optimizer tensors, {step}",
        *(f"             note: {note}" for note in dcp.notes),
    ]
