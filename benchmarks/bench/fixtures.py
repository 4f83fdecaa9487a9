"""The checkpoint under test: size the harness model, build it once with real DeepSpeed, cache it on disk.

Building takes longer than measuring at large sizes, so a finished build is reused across runs; this
module owns the cache layout (``<out>/ckpt/<key>/``) and the model sizing that goes into the key.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .common import MB, REPO, BenchConfig, ModelSpec, RunSpec, dir_bytes, global_batch, logger
from .environment import tool_env

BYTES_PER_PARAM = 12  # ZeRO-3 bf16 optimizer shards: fp32 master + exp_avg + exp_avg_sq


@dataclass
class Checkpoint:
    """A cached harness checkpoint and what it holds."""

    size_mb: int
    root: Path  # holds `latest`
    tag: str
    model: ModelSpec
    params_trainable: int
    bytes_on_disk: int
    build_s: float | None

    @property
    def tag_dir(self) -> Path:
        return self.root / self.tag


def trainable_params(model: ModelSpec) -> int:
    """Parameters the optimizer holds for the harness TinyLM (the frozen projection holds no state)."""
    embed = model.vocab * model.hidden  # the head is tied to it
    head = 0 if model.tied else model.vocab * model.hidden
    block = 2 * model.hidden * model.ffn + model.ffn + model.hidden
    norm = 2 * model.hidden
    return embed + head + model.layers * block + norm


def model_for_size(size_mb: int, hidden: int, ffn: int, vocab: int) -> ModelSpec:
    """Grow the model with ``layers`` only, so the largest parameter is the same at every size."""
    base = ModelSpec(vocab=vocab, hidden=hidden, ffn=ffn, layers=0)
    per_layer = 2 * hidden * ffn + ffn + hidden
    target = size_mb * MB / BYTES_PER_PARAM - trainable_params(base)
    base.layers = max(1, round(target / per_layer))
    return base


def _home(cfg: BenchConfig, size_mb: int) -> tuple[ModelSpec, Path]:
    """The model for ``size_mb`` and the cache folder its build lives in (the key names everything it depends on)."""
    model = model_for_size(size_mb, cfg.hidden, cfg.ffn, cfg.vocab)
    key = f"ckpt-{size_mb}mb-dp{cfg.dp}-v{cfg.vocab}-h{cfg.hidden}-f{cfg.ffn}-l{model.layers}-s{cfg.steps}"
    return model, cfg.out_dir / "ckpt" / key


def cached_bytes(cfg: BenchConfig, size_mb: int) -> int:
    """Bytes a finished cached build of ``size_mb`` holds on disk; 0 when there is none (or --rebuild)."""
    marker = _home(cfg, size_mb)[1] / "build.json"
    if cfg.rebuild or not marker.is_file():
        return 0
    return int(json.loads(marker.read_text())["bytes_on_disk"])


def build_checkpoint(cfg: BenchConfig, size_mb: int) -> Checkpoint:
    """Train ``steps`` steps at DP=cfg.dp with real DeepSpeed (the model built under ``deepspeed.zero.Init``) and
    save; reuse a finished earlier build.

    The marker ``build.json`` is written last, so a half-built folder is never taken for a cache hit.
    """
    model, home = _home(cfg, size_mb)
    marker = home / "build.json"
    if marker.is_file() and not cfg.rebuild:
        meta = json.loads(marker.read_text())
        logger.info("reusing checkpoint %s (%.0f MB)", home, meta["bytes_on_disk"] / MB)
        return Checkpoint(
            size_mb,
            home / "ckpt",
            meta["tag"],
            model,
            meta["params_trainable"],
            meta["bytes_on_disk"],
            meta.get("build_s"),
        )
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    build_s = _train_and_save(cfg, size_mb, model, home)
    root = home / "ckpt"
    tag = (root / "latest").read_text().strip()
    nbytes, _ = dir_bytes(root / tag)
    meta = {
        "tag": tag,
        "params_trainable": trainable_params(model),
        "bytes_on_disk": nbytes,
        "build_s": build_s,
        "model": asdict(model),
        "dp": cfg.dp,
        "steps": cfg.steps,
        "zero_init": True,
    }
    _write_marker(marker, meta)
    logger.info("built %s in %.0f s (%.0f MB on disk)", root / tag, build_s, nbytes / MB)
    return Checkpoint(size_mb, root, tag, model, meta["params_trainable"], nbytes, build_s)


def _train_and_save(cfg: BenchConfig, size_mb: int, model: ModelSpec, home: Path) -> float:
    """Run ``ucp.harness.run_ranks`` into ``home/ckpt``; its wall time in seconds. Exits on failure."""
    spec = RunSpec(
        dp=cfg.dp,
        stage=3,
        dtype="bf16",
        model=model,
        global_batch=global_batch(cfg),
        seq=8,
        steps=cfg.steps,
        save_dir=str(home / "ckpt"),
        zero_init=True,  # each rank builds only its partition: a whole model per rank was OOM-killed at 8 GB
    )
    logger.info(
        "building %d MB checkpoint: DP=%d, %d layers (hidden=%d ffn=%d vocab=%d), %.1f M params",
        size_mb,
        cfg.dp,
        model.layers,
        cfg.hidden,
        cfg.ffn,
        cfg.vocab,
        trainable_params(model) / 1e6,
    )
    # ucp.harness.run_ranks, in a child so that this process never imports torch (see common._load_harness_spec)
    build = [
        sys.executable,
        "-c",
        "import sys; from ucp.harness import RunSpec, run_ranks; "
        "run_ranks(RunSpec.from_json(sys.argv[1]), timeout=float(sys.argv[2]), log_dir=sys.argv[3])",
        spec.to_json(),
        str(cfg.timeout_s),
        str(home / "build-logs"),
    ]
    start = time.perf_counter()
    done = subprocess.run(build, env=tool_env(), cwd=REPO, capture_output=True, text=True, check=False)
    build_s = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"building the {size_mb} MB checkpoint failed:\n{done.stderr[-4000:]}")
    return build_s


def _write_marker(marker: Path, meta: dict[str, Any]) -> None:
    """Write ``build.json`` atomically (temp file, then rename): its presence means the build finished."""
    tmp = marker.with_suffix(".tmp")
    tmp.write_text(json.dumps(meta, indent=2))
    tmp.rename(marker)
