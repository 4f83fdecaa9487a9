"""Rebuild ``tests/data/older``: small real checkpoints written by older DeepSpeed releases.

Users resume runs saved by the DeepSpeed they trained with, often a release or five behind. For each release in
:data:`VERSIONS` this makes a virtual environment beside the current one (its other packages shared), installs
that DeepSpeed from PyPI without building ops, trains the harness's runs in :data:`CASES` on local CPU ranks, and
keeps each checkpoint (its tag folder and ``latest``; not DeepSpeed's ``zero_to_fp32.py``) with the record of what
its live engine held. DeepSpeed before 0.14 runs on CPU only with Intel's extension for PyTorch; 0.14 counts NUMA
nodes with ``numactl``, for which a stand-in is put on PATH.

    python -m tests.support.older_deepspeed --write     # needs network access to PyPI; a few minutes
    python -m tests.support.older_deepspeed --write 0.17.6 --case z3-mics2-bf16-w4   # one release, one case
    python -m tests.support.older_deepspeed --check-live     # ucp.restore into each release's live MiCS engine
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["VERSIONS", "CASES", "DATA"]

#: the releases the data comes from (0.19.8, the current one, is what the rest of the suite runs). 0.18.9's
#: ZeRO-1/2 step fails under torch 2.13 (an in-place write to a split view in its all-gather), so 0.17.6.
VERSIONS = ("0.14.5", "0.16.9", "0.17.6")
#: case name -> RunSpec fields (every other field at the harness's default)
CASES = {
    "z3-bf16-dp2": dict(stage=3, dtype="bf16", dp=2),
    "z2-bf16-dp2": dict(stage=2, dtype="bf16", dp=2),
    "z1-fp32-dp2": dict(stage=1, dtype="fp32", dp=2),
    # MiCS, gone from DeepSpeed 0.19.8: 4 ranks, state sharded over groups of 2 (only the first group saves).
    # No release resumes it: 0.14 to 0.17's MiCS_Optimizer.load_state_dict rejects the engine's param_shapes
    "z3-mics2-bf16-w4": dict(stage=3, dtype="bf16", dp=4, mics=2),
}
DATA = Path(__file__).resolve().parents[1] / "data" / "older"
_ROOT = Path(__file__).resolve().parents[2]

_NUMACTL = """#!/bin/sh
# stand-in for `numactl --hardware`: one NUMA node holding every CPU
echo "available: 1 nodes (0)"
echo "node 0 cpus: $(seq -s ' ' 0 $(($(nproc) - 1)))"
"""

_TRAIN = """
import json, sys
from pathlib import Path
from ucp.harness import RunSpec
from ucp.harness.launch import run_ranks
fields, out = json.loads(sys.argv[1]), Path(sys.argv[2])
spec = RunSpec(**fields, save_dir=str(out / "ckpt"), record=str(out / "record.pt"))
run_ranks(spec, log_dir=out / "logs")
"""


#: checked in the release itself (``--check-live``): ucp.restore into its live MiCS engine resumes the stored
#: checkpoint bit-identically to the run trained on without a break (its own load_checkpoint fails there)
_LIVE = """
import json, sys
from dataclasses import replace
from pathlib import Path
import torch
from tests.support.checks import assert_same_training
from tests.support.fixtures import Built, resume
from ucp.harness import LoadSpec, RunSpec
from ucp.harness.launch import run_ranks
fields, keep, work = json.loads(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
spec = RunSpec(**fields)
run_ranks(replace(spec, steps=2 * spec.steps, record=str(work / "whole.pt")), log_dir=work / "whole-logs")
whole = torch.load(work / "whole.pt", weights_only=True)
whole["losses"] = whole["losses"][spec.steps :]
built = Built(keep / "ckpt", keep / "record.pt", spec)
assert_same_training(whole, resume(built, LoadSpec(str(built.path), kind="ucp"), name="live", work=work))
"""


def _venv(version: str, work: Path) -> tuple[Path, dict[str, str]]:
    """That release's python beside this one (its other packages shared), and the environment its ranks need."""
    venv = work / f"ds-{version}"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", f"deepspeed=={version}"], check=True, env=env
    )
    (work / "bin").mkdir(exist_ok=True)
    numactl = work / "bin" / "numactl"
    numactl.write_text(_NUMACTL)
    numactl.chmod(0o755)
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "PATH": f"{work / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(_ROOT),
    }
    return python, env


def _build(version: str, work: Path, cases: list[str]) -> None:
    python, env = _venv(version, work)
    for name in cases:
        run = work / version / name
        subprocess.run([str(python), "-c", _TRAIN, json.dumps(CASES[name]), str(run)], check=True, env=env, cwd=_ROOT)
        keep = DATA / f"ds-{version}" / name
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(run / "ckpt", keep / "ckpt", ignore=shutil.ignore_patterns("*.py"))
        shutil.copy2(run / "record.pt", keep / "record.pt")
        print(f"deepspeed {version}: {name}", flush=True)


def _check_live(version: str, work: Path) -> None:
    python, env = _venv(version, work)
    for name, fields in CASES.items():
        if fields.get("mics"):
            run = work / version / name
            run.mkdir(parents=True)
            keep = DATA / f"ds-{version}" / name
            subprocess.run([str(python), "-c", _LIVE, json.dumps(fields), str(keep), str(run)], check=True, env=env)
            print(f"deepspeed {version}: {name} restored live by ucp, bit-identical to the run without a break")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rebuild tests/data/older")
    parser.add_argument("versions", nargs="*", default=list(VERSIONS), help="releases to rebuild (default: all)")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="cases to rebuild (default: all)")
    parser.add_argument("--check-live", action="store_true", help="check ucp.restore into each release's MiCS engine")
    args = parser.parse_args()
    if not args.write and not args.check_live:
        parser.error("pass --write to rebuild the data, or --check-live")
    with tempfile.TemporaryDirectory() as work:
        for version in args.versions:
            if args.write:
                _build(version, Path(work), args.case or list(CASES))
            if args.check_live:
                _check_live(version, Path(work))


if __name__ == "__main__":
    main()
