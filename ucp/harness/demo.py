"""``ucp demo``: the whole story on a tiny model, with real DeepSpeed on local CPU ranks.

Train ZeRO-3 at DP=source_dp and save; convert to universal; restore at DP=target_dp; resume there
and compare with DeepSpeed's own native resume at the source DP size, and with DeepSpeed's own
universal loader, step by step.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from ucp.errors import UcpError
from ucp.harness.launch import run_ranks
from ucp.harness.spec import LoadSpec, RunSpec
from ucp.io.atomic import OWNER_MARK, mark_owned, owner_kind

__all__ = ["run_demo", "prepare_workdir"]

logger = logging.getLogger(__name__)
TOLERANCE = 1e-5


def _say(text: str) -> None:
    print(text, flush=True)


def _record(path: Path) -> dict:
    return torch.load(path, weights_only=True)


DEMO_KIND = "demo"


def prepare_workdir(workdir: str | Path) -> Path:
    """An empty folder for the demo: ``workdir`` created now, found empty, or made by an earlier demo
    (its stamp says so) and emptied. Anything else is someone's folder, and is refused untouched."""
    work = Path(workdir).absolute()
    if not os.path.lexists(work):
        try:
            work.mkdir(parents=True)
        except OSError as err:
            raise UcpError(f"cannot create the demo folder {work}: {err.strerror}") from None
    elif not work.is_dir() or work.is_symlink():
        raise UcpError(f"{work} is not a folder; give --workdir a new or empty folder")
    elif owner_kind(work) == DEMO_KIND:
        for child in work.iterdir():
            if child.name == OWNER_MARK:
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    elif any(work.iterdir()):
        raise UcpError(
            f"{work} is not empty and no earlier ucp demo made it; the demo clears its folder, so give "
            "--workdir a new or empty folder"
        )
    mark_owned(work, kind=DEMO_KIND)
    return work


def run_demo(workdir: str | Path, *, source_dp: int = 4, target_dp: int = 2, steps: int = 3) -> int:
    """Run the demo in ``workdir`` (see :func:`prepare_workdir`); 0 when ucp's resume matches the
    native one within 1e-5."""
    import ucp

    work = prepare_workdir(workdir)
    base = RunSpec(
        dp=source_dp,
        stage=3,
        dtype="fp32",
        optimizer="torch-adamw",
        param_groups=2,
        sub_group_size=80,
        global_batch=12 if 12 % source_dp == 0 and 12 % target_dp == 0 else source_dp * target_dp * 3,
    )
    t0 = time.perf_counter()
    _say(f"1. training a tiny LM with DeepSpeed ZeRO-3 on {source_dp} CPU ranks for {steps} steps ...")
    run_ranks(RunSpec(**{**base.__dict__, "steps": steps, "save_dir": str(work / "ds_ckpt")}), log_dir=work / "logs")
    _say(f"2. ucp to-universal {work / 'ds_ckpt'} {work / 'universal'}")
    manifest = ucp.to_universal(work / "ds_ckpt", work / "universal")
    _say(
        f"   {len(manifest['params'])} parameters, optimizer {manifest['optimizer']['flavour']}, "
        f"step {manifest['optimizer']['step']}, {len(manifest['param_groups'])} param groups"
    )
    _say(f"3. ucp restore {work / 'universal'} {work / f'dp{target_dp}_ckpt'} --dp {target_dp}")
    ucp.write_native(work / "universal", work / f"dp{target_dp}_ckpt", dp=target_dp)

    def resume(name: str, dp: int, load: LoadSpec) -> dict:
        spec = RunSpec(
            **{
                **base.__dict__,
                "dp": dp,
                "steps": steps,
                "first_step": steps,
                "load": load,
                "record": str(work / f"{name}.pt"),
            }
        )
        run_ranks(spec, log_dir=work / f"logs-{name}")
        return _record(work / f"{name}.pt")

    _say(f"4. resuming {steps} more steps: DeepSpeed native resume at dp={source_dp} (the reference) ...")
    native = resume("native", source_dp, LoadSpec(str(work / "ds_ckpt")))
    _say(f"   ... ucp's restored checkpoint at dp={target_dp} ...")
    ours = resume("ucp", target_dp, LoadSpec(str(work / f"dp{target_dp}_ckpt")))
    _say(f"   ... and DeepSpeed's own load_universal of the same universal directory at dp={target_dp}")
    try:
        theirs = resume("ds_universal", target_dp, LoadSpec(str(work / "universal"), kind="ds-universal"))
    except Exception as err:  # DeepSpeed's loader is the comparison, not the subject
        logger.warning("DeepSpeed's universal load failed: %s", str(err).splitlines()[0])
        theirs = None

    loss_gap, param_gap = _report(native, ours, theirs, source_dp=source_dp, target_dp=target_dp, steps=steps)
    ok = loss_gap <= TOLERANCE and param_gap <= TOLERANCE
    _say(
        f"\n{'MATCH' if ok else 'MISMATCH'}: ucp's resume at dp={target_dp} "
        f"{'matches' if ok else 'does not match'} DeepSpeed's native resume at dp={source_dp} within {TOLERANCE:g} "
        f"({time.perf_counter() - t0:.0f} s, files in {work})"
    )
    return 0 if ok else 1


def _gap(native: dict, rec: dict) -> tuple[float, float]:
    """The largest loss and parameter differences of a resumed run's record from the native resume's."""
    loss = max(abs(a - b) for a, b in zip(native["losses"], rec["losses"]))
    param = max((native["params"][k] - rec["params"][k]).abs().max().item() for k in native["params"])
    return loss, param


def _report(
    native: dict, ours: dict, theirs: dict | None, *, source_dp: int, target_dp: int, steps: int
) -> tuple[float, float]:
    """Say the resumed runs' losses side by side and how far ucp's (and DeepSpeed's universal load, where it
    ran) is from the native resume; returns ucp's (loss, parameter) gap."""
    _say("")
    _say(
        f"{'step':>6} {'native dp=' + str(source_dp):>16} {'ucp dp=' + str(target_dp):>16}"
        + (f" {'ds universal':>16}" if theirs else "")
    )
    for i, loss in enumerate(native["losses"]):
        row = f"{steps + i + 1:>6} {loss:>16.8f} {ours['losses'][i]:>16.8f}"
        if theirs:
            row += f" {theirs['losses'][i]:>16.8f}"
        _say(row)
    loss_gap, param_gap = _gap(native, ours)
    _say(
        f"\nucp:                 max |loss diff| {loss_gap:.2e}, max |param diff| {param_gap:.2e}, "
        f"optimizer step {ours['state_steps'][0]:.0f} (native {native['state_steps'][0]:.0f}), "
        f"lr per group {[f'{x:.5f}' for x in ours['lrs']]}"
    )
    if theirs:
        their_loss, their_param = _gap(native, theirs)
        _say(
            f"DeepSpeed universal: max |loss diff| {their_loss:.2e}, max |param diff| {their_param:.2e}, "
            f"optimizer step {theirs['state_steps'][0]:.0f}, lr per group {[f'{x:.5f}' for x in theirs['lrs']]}"
        )
    return loss_gap, param_gap


if __name__ == "__main__":
    sys.exit(run_demo("ucp-demo"))
