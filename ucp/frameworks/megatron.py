"""The one owner of Megatron-Core's ``torch_dist`` checkpoint layout as Megatron-LM saves it (megatron-core 0.16).

A run folder holds ``latest_checkpointed_iteration.txt`` and ``iter_NNNNNNN/``; the iteration folder is a DCP folder
written with flat keys (no planner data) plus ``metadata.json`` (``sharded_backend: torch_dist``) and ``common.pt``
(the unsharded rest: ``args``, ``iteration``, the optimizer's sharding type and, for ``fully_reshardable``, its param
groups, ``opt_param_scheduler``, ``content_metadata``).

Model keys are TP-invariant global tensors; every transformer layer's tensors share one key with the layer as a
leading axis (``decoder.layers.mlp.linear_fc1.weight`` of shape (layers, 2F, H), one chunk per layer and TP shard).
ucp names one layer's parameter ``decoder.layers.<l>.<sub>`` (:func:`layer_name`). The distributed optimizer's state
is either per model key (``fully_reshardable``: ``optimizer.state.<state key>.<model key>``, same shape and chunks)
or per flat DDP bucket of one model-parallel rank (``dp_reshardable``: ``optimizer.distributed.dp_group_idx_<G>.
gbuf_idx_<B>.dtype_<(param, grad)>.bucket_idx_<K>.<state key>``), laid out as Megatron's ``_ParamAndGradBuffer``
lays the rank's parameters out (:func:`bucket_layout`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucp.errors import InputError
from ucp.io.small_files import read_small

__all__ = [
    "LATEST_ITERATION",
    "METADATA_JSON",
    "COMMON",
    "FULLY",
    "DP_RESHARDABLE",
    "LAYERS",
    "MegatronFolder",
    "find_megatron",
    "iteration_dir",
    "layer_name",
    "split_layer",
    "object_key",
    "state_key",
    "bucket_key",
    "BUCKET",
    "bucket_layout",
    "LAYER_ORDERS",
    "stage_layers",
    "stage_order",
    "args_of",
    "Box",
    "tp_boxes",
]

LATEST_ITERATION = "latest_checkpointed_iteration.txt"
METADATA_JSON, COMMON = "metadata.json", "common.pt"
FULLY, DP_RESHARDABLE = "fully_reshardable", "dp_reshardable"
#: the stacked keys' prefix: one key per kind of tensor of every transformer layer
LAYERS = "decoder.layers."
_ITER = re.compile(r"^iter_(\d{7})$")
#: a dp_reshardable bucket tensor: dp group (model-parallel rank), DDP buffer, dtypes, bucket, state key
BUCKET = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_(\(.*\))\.bucket_idx_(\d+)\.(\w+)$"
)
#: where each layer's tensors sit among the layer's parameters (``named_parameters`` order), by the sub-key the
#: checkpoint names them with: Megatron's local layer spec (norms as modules of their own) and Transformer Engine's
#: (norms fused into the next linear); a bias follows its weight
_ATTN_NORM = ("self_attention.linear_qkv.layer_norm_weight",)
_PROJ = ("self_attention.linear_proj.weight", "self_attention.linear_proj.bias")
_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_MLP = ("mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight", "mlp.linear_fc1.bias", "mlp.linear_fc2.weight",
        "mlp.linear_fc2.bias")  # fmt: skip
LAYER_ORDERS: dict[str, tuple[str, ...]] = {
    "local": _ATTN_NORM + _PROJ + _QKV + _MLP,
    "transformer-engine": _PROJ + _ATTN_NORM + _QKV + _MLP,
}


@dataclass(frozen=True)
class MegatronFolder:
    """An iteration folder of a Megatron-LM run, and the run folder around it (None: given the iteration folder)."""

    path: Path
    root: Path | None
    iteration: int | None


def _torch_dist(path: Path) -> bool:
    meta = path / METADATA_JSON
    if not meta.is_file() or not (path / ".metadata").is_file():
        return False
    try:
        record = json.loads(read_small(meta, 1 << 16, "Megatron metadata.json"))
    except (ValueError, InputError):
        return False
    return isinstance(record, dict) and record.get("sharded_backend") == "torch_dist"


def iteration_dir(root: Path, iteration: int) -> Path:
    return root / f"iter_{iteration:07d}"


def find_megatron(path: Path) -> MegatronFolder | None:
    """The torch_dist iteration folder at ``path`` (the iteration folder itself, or the run folder whose
    ``latest_checkpointed_iteration.txt`` names it), or None when ``path`` is no Megatron checkpoint (a run folder
    whose latest iteration folder is missing is not claimed either: the DeepSpeed layout's reason is then given)."""
    latest = path / LATEST_ITERATION
    if latest.is_file():  # verl's trainer writes a file of that name too, naming global_step_N: not ours then
        text = read_small(latest, 64, "latest_checkpointed_iteration.txt").decode(errors="replace").strip()
        folder = iteration_dir(path, int(text)) if text.isdigit() else None
        return MegatronFolder(folder, path, int(text)) if folder is not None and _torch_dist(folder) else None
    if not _torch_dist(path):
        return None
    match = _ITER.match(path.name)
    return MegatronFolder(path, None, int(match.group(1)) if match else None)


def layer_name(key: str, layer: int) -> str:
    """One layer's parameter name for a stacked key: ``decoder.layers.mlp.linear_fc1.weight``, 3 ->
    ``decoder.layers.3.mlp.linear_fc1.weight``."""
    return f"{LAYERS}{layer}.{key[len(LAYERS) :]}"


def split_layer(name: str) -> tuple[str, int | None]:
    """The checkpoint key and layer of a parameter name (layer None: a key of its own)."""
    match = re.match(r"^decoder\.layers\.(\d+)\.(.+)$", name)
    return (f"{LAYERS}{match.group(2)}", int(match.group(1))) if match else (name, None)


def object_key(fqn: str) -> str:
    """A ShardedObject's key without its ``/shard_<offset>_<shape>`` suffix."""
    return fqn.split("/shard_", 1)[0]


def state_key(state: str, key: str) -> str:
    """``fully_reshardable``: the key of optimizer state ``state`` (``param`` is the fp32 master) of model key."""
    return f"optimizer.state.{state}.{key}"


def bucket_key(group: int, gbuf: int, dtypes: str, bucket: int, state: str) -> str:
    return f"optimizer.distributed.dp_group_idx_{group}.gbuf_idx_{gbuf}.dtype_{dtypes}.bucket_idx_{bucket}.{state}"


def bucket_layout(
    params: Sequence[tuple[str, int]], unpadded: Sequence[int], dp: int
) -> tuple[dict[str, tuple[int, int, int]], list[int]] | None:
    """Where Megatron's DDP buffer puts each parameter, from the parameters (name, local numel) in
    ``named_parameters`` order and the buckets' unpadded sizes the checkpoint records: ``{name: (bucket, start,
    end)}`` in bucket coordinates, and each bucket's padded size; None when the parameters do not fill the buckets
    as recorded (another order or another model).

    The buffer takes the parameters in reverse order, each starting at a multiple of 64 elements; a bucket ends after
    the parameter that fills it (the recorded unpadded size) and is padded to a multiple of lcm(dp, 128)."""
    place: dict[str, tuple[int, int, int]] = {}
    padded: list[int] = []
    bucket, start = 0, 0
    for name, numel in reversed(params):
        if bucket >= len(unpadded):
            return None
        start = _round_up(start, 64)
        end = start + numel
        if end > unpadded[bucket]:
            return None
        place[name] = (bucket, start, end)
        if end == unpadded[bucket]:
            padded.append(_round_up(end, math.lcm(dp, 128)))
            bucket, start = bucket + 1, 0
        else:
            start = end
    return (place, padded) if bucket == len(unpadded) else None


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def stage_layers(layers: int, pp: int, stage: int) -> range:
    """The layers of pipeline stage ``stage``: Megatron's even split (its first/last-stage overrides are not read)."""
    if layers % pp:
        raise InputError(f"{layers} layers do not split evenly over {pp} pipeline stages; ucp reads even splits")
    per = layers // pp
    return range(stage * per, (stage + 1) * per)


def stage_order(names: Iterable[str], layers: range, stage: int, pp: int, order: Sequence[str]) -> list[str]:
    """The parameters of one pipeline stage in ``named_parameters`` order: the embedding (first stage), each layer's
    by ``order``, the final norm and output layer (last stage)."""
    have = set(names)
    out = [n for n in ("embedding.word_embeddings.weight",) if stage == 0 and n in have]
    for layer in layers:
        out += [f"{LAYERS}{layer}.{sub}" for sub in order if f"{LAYERS}{layer}.{sub}" in have]
    if stage == pp - 1:
        out += [n for n in ("decoder.final_layernorm.weight", "decoder.final_layernorm.bias", "output_layer.weight")
                if n in have]  # fmt: skip
    return out


def args_of(common: Mapping[str, Any]) -> dict[str, Any]:
    """``common.pt``'s ``args`` as a plain dict (the argparse Namespace is read as an inert stand-in)."""
    args = common.get("args")
    if args is None:
        return {}
    return dict(vars(args)) if hasattr(args, "__dict__") else dict(args) if isinstance(args, Mapping) else {}


#: a box of a tensor: (offsets, sizes)
Box = tuple[tuple[int, ...], tuple[int, ...]]


def tp_boxes(key: str, chunks: Sequence[Any], layer: int | None, tp: int, swiglu: bool) -> list[list[Box]]:
    """For each of ``tp`` tensor-parallel ranks, the boxes of the (one layer's) parameter that rank holds, in the
    order its local tensor concatenates them along dim 0, from the chunks the checkpoint stores (one per TP shard,
    replicas removed): one chunk is replicated; ``tp`` chunks split one dim; a SwiGLU ``linear_fc1`` stores 2 x tp
    (every rank's gate rows, then every rank's up rows: rank r holds gate r and up r)."""
    boxes: list[Box] = []
    for chunk in chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if layer is not None:
            if offsets[0] != layer:
                continue
            offsets, sizes = offsets[1:], sizes[1:]
        boxes.append((offsets, sizes))
    boxes.sort()
    if len(boxes) == 1:
        return [boxes] * tp
    fused = swiglu and key.endswith(("linear_fc1.weight", "linear_fc1.bias"))
    if fused and len(boxes) == 2 * tp:
        return [[boxes[r], boxes[tp + r]] for r in range(tp)]
    if len(boxes) == tp and not fused:
        return [[box] for box in boxes]
    raise InputError(
        f"{key}{'' if layer is None else f' (layer {layer})'} is stored in {len(boxes)} chunks, which is no "
        f"tensor-parallel split over {tp} ranks that ucp knows"
    )
