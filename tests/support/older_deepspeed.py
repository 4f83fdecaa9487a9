"""Rebuild ``tests/data/older``: small real checkpoints written by older DeepSpeed releases.

Users resume runs saved by the DeepSpeed they trained with, often a release or five behind. For each release in
:data:`VERSIONS` this makes a virtual environment beside the current one (its other packages shared), installs
that DeepSpeed from PyPI without building ops, trains the harness's runs in :data:`CASES` on local CPU ranks, and
keeps each checkpoint (its tag folder and ``latest``; not DeepSpeed's ``zero_to_fp32.py``) with the record of what
its live engine held. DeepSpeed before 0.14 runs on CPU only with Intel's extension for PyTorch; 0.14 counts NUMA
nodes with ``numactl``, for which a stand-in is put on PATH.

    python -m tests.support.older_deepspeed --write     # needs network access to PyPI; a few minutes
    python -m tests.support.older_deepspeed --write 0.17.6 --case z3-mics2-bf16-w4   # one release, one case
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


def _build(version: str, work: Path, cases: list[str]) -> None:
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
    for name in cases:
        run = work / version / name
        subprocess.run([str(python), "-c", _TRAIN, json.dumps(CASES[name]), str(run)], check=True, env=env, cwd=_ROOT)
        keep = DATA / f"ds-{version}" / name
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(run / "ckpt", keep / "ckpt", ignore=shutil.ignore_patterns("*.py"))
        shutil.copy2(run / "record.pt", keep / "record.pt")
        print(f"deepspeed {version}: {name}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rebuild tests/data/older")
    parser.add_argument("versions", nargs="*", default=list(VERSIONS), help="releases to rebuild (default: all)")
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="cases to rebuild (default: all)")
    args = parser.parse_args()
    if not args.write:
        parser.error("pass --write to rebuild the data")
    with tempfile.TemporaryDirectory() as work:
        for version in args.versions:
            _build(version, Path(work), args.case or list(CASES))


if __name__ == "__main__":
    main()
