"""What every part of the benchmark shares: paths, units, the run configuration and the harness specs.

Kept separate so that fixtures, measurement and reporting can each import it without importing one
another, and so that the one place that loads ``ucp/harness/spec.py`` (without ``ucp``) is easy to find.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]

MB = 1_000_000  # sizes are decimal megabytes, as `ls -l` bytes / 1e6

logger = logging.getLogger("bench_convert")


def _load_harness_spec() -> ModuleType:
    """ucp/harness/spec.py on its own, without importing the ``ucp`` package.

    Importing ``ucp`` imports torch (~225 MiB). A child started with fork/vfork inherits its parent's
    peak RSS into its own ru_maxrss (Linux keeps the old mm's high-water mark across exec), so a heavy
    parent would put a floor under every number measured here. spec.py needs only json and dataclasses.
    """
    name = "_bench_harness_spec"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "ucp" / "harness" / "spec.py")
        assert spec is not None and spec.loader is not None, "ucp/harness/spec.py is missing"
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
        spec.loader.exec_module(module)
    return sys.modules[name]


_spec = _load_harness_spec()
LoadSpec, ModelSpec, RunSpec = _spec.LoadSpec, _spec.ModelSpec, _spec.RunSpec


@dataclass(frozen=True)
class BenchConfig:
    """Everything a run depends on; parsed once from the command line and passed down."""

    sizes_mb: tuple[int, ...]
    rounds: int
    dp: int
    restore_dp: int
    reshard_dp: int
    hidden: int
    ffn: int
    vocab: int
    steps: int
    ds_workers: int
    import_reps: int
    out_dir: Path
    timeout_s: float
    sample_interval_s: float
    ucp_src: str  # "tag": the folder holding the shard files; "root": the folder holding `latest`
    skip_loads: bool
    ds_temp_probe: bool
    rebuild: bool
    keep_outputs: bool
    plot: bool
    check: bool


def global_batch(cfg: BenchConfig) -> int:
    """The smallest batch both DP sizes divide (the harness slices one global batch per rank)."""
    return math.lcm(cfg.dp, cfg.restore_dp)


def dir_bytes(path: Path) -> tuple[int, int]:
    """(apparent bytes, file count) under ``path``; 0 when it does not exist."""
    total = files = 0
    if not path.exists():
        return 0, 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
                files += 1
            except OSError:
                pass
    return total, files
