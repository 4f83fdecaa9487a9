"""A migration's DCP-shaped targets, planned and described here: ``target.format: dcp`` (written by
ucp.targets.dcp) and a Trainer or Accelerate folder of an FSDP run (ucp.targets.hf_fsdp), whose model and optimizer
are the same state dicts.

Neither has a layout to decide (DCP reshards on load; FULL files are whole), so planning only runs the writer's own
planner on the transformed facts, to refuse before anything is written what the writer would refuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ucp.errors import UcpError
from ucp.migrate.issues import Issue
from ucp.migrate.schema import TargetConfig
from ucp.model.layouts import DEEPSPEED, RunFolder
from ucp.model.option_table import not_taken
from ucp.model.options import parse_step
from ucp.model.records import Reader
from ucp.transforms import TransformPlan

__all__ = ["plan_dcp_target", "describe_dcp", "fsdp_backend"]

_STATE_DICT = {"fsdp-sharded": "SHARDED_STATE_DICT", "fsdp-full": "FULL_STATE_DICT"}


def fsdp_backend(target: TargetConfig, folder: RunFolder | None, issues: list[Issue]) -> str | None:
    """The backend of the FSDP run's folder the target is written as (None: the target is no such folder), with
    what such a folder does not take (or ``backend`` without a folder to apply it to) added to ``issues``."""
    if folder is None:
        if target.backend is not None and target.format != "dcp":
            issues.append(
                Issue(("target", "backend"), "applies to a Trainer or Accelerate folder, which the source is not")
            )
        return None
    backend = target.backend or folder.backend
    if backend == DEEPSPEED:
        return None
    for o in not_taken("hf-fsdp-folder", target.values()):
        assert o.yaml is not None  # only keys of the YAML are in values()
        issues.append(
            Issue(
                ("target", o.yaml),
                "describes a DeepSpeed output; an FSDP run's folder holds fp32 masters that FSDP loads at any "
                "process count: remove it, or set backend: deepspeed",
            )
        )
    return backend


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


def describe_dcp(
    dcp: Any, target: TargetConfig, counts: str, steps: Mapping[str, int], *, folder: tuple[str, str] | None = None
) -> list[str]:
    """The dry-run lines of a dcp target, or of an FSDP run's ``folder`` (its kind and backend): what it will hold,
    for which optimizer, at which steps."""
    top = [k for k in dcp.state if k in ("optim", "optimizer", "lr_scheduler", "train_state")]
    model = "model FQNs at the top level" if dcp.layout == "torchtitan" else "model"
    known = sorted(set(steps.values()))
    step = f"step {known[0]}" if len(known) == 1 else f"steps {known}"
    tensors = sum(1 for key in dcp.lazy if ".state." in key)
    if folder is None:
        what = f"torch.distributed.checkpoint folder ({dcp.layout} layout) for {dcp.flavour}, fp32, any world size: "
        what += f"{model}, {', '.join(top)}"
    else:
        kind, backend = folder
        what = (
            f"a whole {kind} folder of an FSDP run ({_STATE_DICT[backend]}) for {target.dp} processes, "
            f"{dcp.flavour}, fp32: model, optimizer, scheduler, RNG files and the folder's other files"
        )
    return [
        f"write      {target.output}: {what}",
        f"             {counts}; {tensors} optimizer tensors, {step}",
        *(f"             note: {note}" for note in dcp.notes),
    ]
