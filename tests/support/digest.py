"""What a written file holds, as a hash: its bytes, and its loaded content in canonical form.

Pickled torch files do not come out byte-identical from run to run (the pickler's memo and dict
order differ where the content does not), so tests that compare outputs compare the loaded content.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

__all__ = ["canonical", "load", "digest", "tree"]


def canonical(obj: Any) -> Any:
    """A JSON-able picture of a loaded object that any equal object gives, whoever pickled it."""
    if torch.is_tensor(obj):
        data = obj.detach().contiguous().reshape(-1)
        raw = data.view(torch.uint8).numpy().tobytes() if data.numel() else b""
        return ["tensor", str(obj.dtype), list(obj.shape), hashlib.sha256(raw).hexdigest()]
    if isinstance(obj, OrderedDict):
        return ["odict", [[canonical(k), canonical(v)] for k, v in obj.items()]]
    if isinstance(obj, dict):
        return ["dict", [[canonical(k), canonical(v)] for k, v in obj.items()]]
    if isinstance(obj, (list, tuple)):
        return [type(obj).__name__, [canonical(v) for v in obj]]
    if isinstance(obj, (set, frozenset)):
        return ["set", sorted(json.dumps(canonical(v)) for v in obj)]
    if isinstance(obj, torch.Size):
        return ["size", list(obj)]
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, (int, float)):
        return [
            type(obj).__name__ if type(obj) in (int, float) else f"{type(obj).__module__}.{type(obj).__qualname__}",
            repr(obj) if type(obj) in (int, float) else int(obj),
        ]
    return ["object", f"{type(obj).__module__}.{type(obj).__qualname__}", canonical(dict(vars(obj)))]


def load(path: Path) -> Any:
    """torch.load with DeepSpeed's real classes allowed (the files name them), nothing else."""
    import argparse as _argparse

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals(
        [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, _argparse.Namespace]
    ):
        return torch.load(path, weights_only=True)


def digest(path: Path) -> dict[str, Any]:
    raw = path.read_bytes()
    entry: dict[str, Any] = {"sha256": hashlib.sha256(raw).hexdigest()}
    if raw[:4] == b"PK\x03\x04":
        entry["content"] = hashlib.sha256(json.dumps(canonical(load(path))).encode()).hexdigest()
    elif path.suffix == ".safetensors":  # the library writes its metadata map in hash order: compare it parsed
        size = int.from_bytes(raw[:8], "little")
        header = json.dumps(json.loads(raw[8 : 8 + size]), sort_keys=True).encode()
        entry["content"] = hashlib.sha256(header + raw[8 + size :]).hexdigest()
    elif path.name == "ucp.json":
        manifest = json.loads(raw)
        manifest["files"].pop("state.pt")
        entry["content"] = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    return entry


def tree(out: Path) -> dict[str, dict[str, Any]]:
    return {str(p.relative_to(out)): digest(p) for p in sorted(out.rglob("*")) if p.is_file()}
