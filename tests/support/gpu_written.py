"""The checkpoints real GPUs wrote (gpu/run.sh): tests/data/gpu-written.tgz, or a newer set unpacked at
$UCP_GPU_CHECKPOINTS. Each run is a folder with ``ckpt/``, ``record.pt`` (what its live engine held) and
``spec.json``; tests/test_device_flavours.py's cells at the top, tests/test_cuda_modes.py's under ``modes/``."""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
from pathlib import Path

from tests.support.fixtures import Built, cache_root
from ucp.harness import RunSpec

DATA = Path(__file__).resolve().parents[1] / "data" / "gpu-written.tgz"


def gpu_written_root() -> Path:
    """The folder of GPU-written runs: $UCP_GPU_CHECKPOINTS, or the kept set unpacked once into the cache."""
    if os.environ.get("UCP_GPU_CHECKPOINTS"):
        return Path(os.environ["UCP_GPU_CHECKPOINTS"])
    digest = hashlib.sha1(DATA.read_bytes()).hexdigest()[:12]
    root = cache_root() / f"gpu-written-{digest}"
    if not (root / ".unpacked").exists():
        partial = root.with_name(f"{root.name}.partial-{os.getpid()}")
        partial.mkdir(parents=True, exist_ok=True)
        with tarfile.open(DATA) as archive:
            archive.extractall(partial, filter="data")
        (partial / ".unpacked").write_text("ok")
        try:
            partial.rename(root)
        except OSError:  # another process unpacked it first
            shutil.rmtree(partial, ignore_errors=True)
    return root


def written(folder: Path) -> Built:
    """One GPU-written run: its checkpoint, live record and spec."""
    spec = RunSpec.from_json((folder / "spec.json").read_text())
    return Built(folder / "ckpt", folder / "record.pt", spec)
