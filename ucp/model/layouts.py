"""Typed records of how a source is laid out beyond one flat model, carried in :class:`~ucp.model.records.Facts`.

A composite source (pipeline stages, legacy MoE or AutoEP layers) describes its layout as a :class:`SourceLayout`;
a source wrapped in a training framework's run folder (a Hugging Face Trainer ``checkpoint-N`` or an Accelerate
``save_state`` folder) carries the folder as a :class:`RunFolder`. Targets read both here, never from a source
module or a reader's attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "LAYOUT_KINDS",
    "LayoutKind",
    "SourceLayout",
    "RunFolder",
    "BACKENDS",
    "DEEPSPEED",
    "FSDP_SHARDED",
    "FSDP_FULL",
]

LayoutKind = Literal["pipeline", "moe", "autoep"]
#: the layouts a source can have, as ucp.json names them (docs/format.md section 8)
LAYOUT_KINDS: tuple[LayoutKind, ...] = ("pipeline", "moe", "autoep")


#: what holds a run folder's model and optimizer: DeepSpeed's tag folder and ``latest``; Accelerate's FSDP save
#: under SHARDED_STATE_DICT (two DCP folders) or under FULL_STATE_DICT (two whole torch files)
DEEPSPEED, FSDP_SHARDED, FSDP_FULL = "deepspeed", "fsdp-sharded", "fsdp-full"
BACKENDS = (DEEPSPEED, FSDP_SHARDED, FSDP_FULL)


@dataclass(frozen=True)
class SourceLayout:
    """A composite source's layout: ``kind``, and ``record``, the JSON-ready description that ucp.json keeps and
    ``ucp inspect`` shows (pipeline stages; MoE layers and their expert-parallel size; AutoEP layers, their
    placement and fused shapes). The owners of DeepSpeed's layout (``ucp.deepspeed.moe``, ``.autoep``) read it."""

    kind: LayoutKind
    record: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {self.kind: dict(self.record)}


@dataclass(frozen=True)
class RunFolder:
    """What a training framework's run folder holds around its checkpoint, by file name (nothing unpickled)."""

    path: Path
    kind: str  # "trainer" | "accelerate"
    tag: str  # the DeepSpeed tag folder the framework loads ("" for an FSDP run)
    rng_files: tuple[str, ...]  # one per old process, in process order
    files: tuple[str, ...]  # every other entry, copied unchanged
    skipped: tuple[str, ...]  # other DeepSpeed tag folders, not carried (their shards fit the old size only)
    trainer_state: dict[str, Any] | None
    #: what holds the model and optimizer state: one of BACKENDS
    backend: str = DEEPSPEED
    #: an FSDP run's state entries (model, optimizer), written anew rather than copied
    state: tuple[str, ...] = ()

    @property
    def fsdp(self) -> bool:
        return self.backend != DEEPSPEED

    @property
    def old_world(self) -> int | None:
        """Processes of the run that saved it, as its RNG files count them."""
        return len(self.rng_files) or None

    @property
    def global_step(self) -> int | None:
        return None if self.trainer_state is None else self.trainer_state.get("global_step")

    def describe(self) -> dict[str, Any]:
        """The JSON summary ``ucp inspect`` shows."""
        return {
            "kind": self.kind,
            "backend": self.backend,
            "tag": self.tag,
            "state": list(self.state),
            "global_step": self.global_step,
            "processes": self.old_world,
            "rng_files": list(self.rng_files),
            "files": list(self.files),
            "skipped": list(self.skipped),
            "train_batch_size": None if self.trainer_state is None else self.trainer_state.get("train_batch_size"),
        }


@dataclass(frozen=True)
class MegatronRun:
    """What a Megatron-LM run's torch_dist checkpoint holds besides its parameters' state, read once from
    ``common.pt`` and the byte items: ``args`` (the model's config and the parallel sizes, as Megatron-LM's argparse
    namespace had them), the optimizer's sharding type, the run's sizes, ``common`` (the rest of ``common.pt``:
    ``opt_param_scheduler``, ``checkpoint_version``, ``content_metadata``, counters) and ``objects`` (the per-layer
    ShardedObjects, ``_extra_state``, by key and layer), ``rng`` (the RNG state's items, as bytes)."""

    args: Mapping[str, Any]
    sharding: str
    tp: int
    pp: int
    dp: int
    common: Mapping[str, Any]
    objects: Mapping[str, Any]
    #: the RNG state's items as saved (torch.save blobs holding numpy state, never unpickled), by key
    rng: Mapping[str, bytes]

    def describe(self) -> dict[str, Any]:
        """The JSON summary ``ucp inspect`` shows."""
        model = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "padded_vocab_size", "normalization", "swiglu", "position_embedding_type")  # fmt: skip
        return {
            "sharding": self.sharding,
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "model": {k: self.args[k] for k in model if isinstance(self.args.get(k), (int, float, str, bool))},
        }
