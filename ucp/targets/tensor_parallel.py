"""Full parameters -> one tensor-parallel rank's shards, as a reader every target can consume.

:class:`TpShardReader` wraps any reader of full parameters (a universal directory, a merged TP
checkpoint) and presents TP rank ``k``'s view: shard shapes in the facts, shard tensors from
``read``. The native and live-engine targets then write or load that view exactly as they do a
plain checkpoint. Where each rank's blocks come from is decided per parameter by, in order: an
exact layout the target supplies (a live AutoTP model's affine map), the rule recorded in the
universal manifest (or given in the migration YAML), or, for a parameter whose target shape is its
full shape, replication.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from ucp.errors import CorruptFileError, InputError
from ucp.model import tp as tpl
from ucp.model.records import ParamMeta, ParamState, PieceState, Reader, ReaderView

__all__ = ["TpShardReader", "rank_layouts", "target_tp_info", "live_tp_view"]


def rank_layouts(
    reader: Reader,
    tp: int,
    rank: int,
    *,
    rules: Mapping[str, tpl.TpRule] | None = None,
    exact: Mapping[str, tpl.RankLayout] | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> dict[str, tpl.RankLayout]:
    """Per parameter, the blocks TP ``rank`` of ``tp`` holds.

    ``exact`` layouts win; then ``rules`` (default: the reader's recorded ones). ``shapes`` are
    the target's shard shapes where known (a live engine): a parameter with no rule whose target
    shape is its full shape is replicated, and every layout is checked against them.
    """
    try:
        recorded = {n: tpl.TpRule.from_json(r) for n, r in reader.facts.tp_rules.items()}
    except (tpl.TpInfoError, AttributeError) as err:
        raise CorruptFileError(f"the checkpoint's tensor-parallel rules are malformed: {err}") from None
    rules = dict(recorded if rules is None else rules)
    out = {}
    for meta in reader.facts.params:
        name = meta.name
        if exact and name in exact:
            layout = exact[name]
        elif name in rules:
            try:
                layout = tpl.rank_layout(rules[name], meta.shape, tp, rank)
            except tpl.TpInfoError as err:
                raise InputError(f"{name}: {err}") from None
        elif tp == 1 or (shapes is not None and tuple(shapes.get(name, ())) == tuple(meta.shape)):
            layout = tpl.rank_layout(tpl.REPLICATED, meta.shape, tp, rank)
        else:
            raise InputError(
                f"no tensor-parallel rule for {name!r} to cut it for TP={tp}: the checkpoint was not "
                "saved with tensor parallelism; give the rules in the migration YAML "
                "(tensor_parallel.rules)"
            )
        if shapes is not None and name in shapes and tuple(shapes[name]) != tuple(layout.shard_shape):
            raise InputError(
                f"{name}: TP rank {rank} of the target holds shape {tuple(shapes[name])}, the "
                f"checkpoint's rule {rules.get(name, tpl.REPLICATED).to_json()} gives "
                f"{tuple(layout.shard_shape)} for full shape {meta.shape} at TP={tp}"
            )
        out[name] = layout
    return out


class TpShardReader(ReaderView):
    """TP rank ``rank``'s view of a reader of full parameters (closing it leaves that reader open).

    Each tensor is cut from the full one, so nothing streams: pieces are the cut tensors."""

    def __init__(self, reader: Reader, layouts: Mapping[str, tpl.RankLayout], *, tp: int, rank: int) -> None:
        self.layouts = dict(layouts)
        self.tp, self.rank = tp, rank
        facts = reader.facts
        params = [
            ParamMeta(m.name, tuple(self.layouts[m.name].shard_shape), m.dtype, m.group, m.frozen) for m in facts.params
        ]
        super().__init__(reader, replace(facts, params=params, info=replace(facts.info, mp_world_size=tp)))
        self.streams = False

    @property
    def full(self) -> Reader:
        """The reader of full parameters this view cuts."""
        return self.inner

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        state = self.inner.read(name, moments=moments)
        layout = self.layouts[name]
        return ParamState(
            fp32=tpl.scatter(state.fp32, layout),
            optim={k: tpl.scatter(v, layout) for k, v in state.optim.items()},
            step=state.step,
            scalars=state.scalars,
        )

    @contextmanager
    def read_pieces(self, name: str, *, moments: bool = True) -> Iterator[PieceState]:
        yield PieceState.of(self.read(name, moments=moments))


def target_tp_info(reader: Reader, tp: int) -> dict[str, Any]:
    """A ``universal_checkpoint_info`` for a checkpoint written at TP=``tp``: DeepSpeed's pattern lists
    (what its converter and ucp read back) plus an affine map of the exact layout."""
    if isinstance(reader, TpShardReader):
        reader = reader.full
    rules = {n: tpl.TpRule.from_json(r) for n, r in reader.facts.tp_rules.items()}
    exact = {}
    replicated, average, row, sub_params, widths = [], [], [], [], {}
    vocab: list[str] = []
    original = None
    for meta in reader.facts.params:
        rule = rules.get(meta.name, tpl.REPLICATED)
        pattern = f"^{re.escape(meta.name)}$"
        if rule.kind == "replicated":
            replicated.append(pattern)
        elif rule.kind == "average":
            average.append(pattern)
        elif rule.parts:
            shape: list[Any] = [-1] * len(meta.shape)
            shape[rule.dim] = list(rule.parts)
            sub_params.append({"patterns": [pattern], "shape": shape, "partition_dim": rule.dim})
            widths[pattern] = [tpl.shard_widths(p, tp) for p in rule.parts]
        elif rule.dim == 1:
            row.append(pattern)
        if rule.vocab is not None:
            vocab.append(pattern)
            original = rule.vocab
        layouts = tpl.layouts_for(rule, meta.shape, tp)
        exact[pattern] = {
            "logical_shape": list(meta.shape),
            "ranks": {
                r: {
                    "shard_shape": list(lay.shard_shape),
                    "pieces": [
                        {
                            "shape": list(p.shape),
                            "source": [p.full_offset, list(p.full_strides)],
                            "dest": [p.shard_offset, list(p.shard_strides)],
                            "locations": list(range(tp)) if lay.replicated else [r],
                        }
                        for p in lay.pieces
                    ],
                }
                for r, lay in enumerate(layouts)
            },
        }
    info: dict[str, Any] = {
        "universal_checkpoint_version": 0.4,
        "tp_replicated_parameter_patterns": replicated,
        "parameter_to_average_patterns": average,
        "parameter_with_row_parallelism_patterns": row,
        "vocabulary_parameter_patterns": vocab,
        "parameter_with_sub_params": sub_params,
        "sub_param_shard_widths": widths,
        "affine_map": {"version": 1, "params": exact},
    }
    if original is not None:
        info["original_vocab_size"] = original
    return info


def _live_tp_degree(engine: Any) -> tuple[int, int]:
    """(TP size, TP rank) of this rank of a live engine: from the engine's mpu when it has one (a
    PipelineEngine's grid, Megatron's mpu), else from DeepSpeed's groups (AutoTP); (1, 0) without TP."""
    mpu = getattr(engine, "mpu", None)
    try:
        if mpu is not None and hasattr(mpu, "get_tensor_model_parallel_world_size"):
            return int(mpu.get_tensor_model_parallel_world_size()), int(mpu.get_tensor_model_parallel_rank())
        from deepspeed.utils import groups

        return int(groups.get_tensor_model_parallel_world_size()), int(groups.get_tensor_model_parallel_rank())
    except (ImportError, AttributeError, AssertionError, RuntimeError):
        return 1, 0


def live_tp_view(engine: Any, reader: Reader) -> Reader:
    """``reader`` as this rank of a live tensor-parallel engine sees it (``reader`` itself at TP=1).

    The live model's own ``universal_checkpoint_info`` (DeepSpeed AutoTP attaches it) gives the
    exact layout of each parameter it names; the rest follow the checkpoint's rules.
    """
    tp, rank = _live_tp_degree(engine)
    if tp <= 1:
        return reader
    module = getattr(engine, "module", engine)
    info = getattr(module, "universal_checkpoint_info", None) or {}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, param in module.named_parameters():
        shapes.setdefault(name, tuple(param.shape))
    exact = {}
    try:
        for meta in reader.facts.params:
            found = tpl.affine_layouts(info, meta.name, tp) if info else None
            if found is not None:
                full, per_rank = found
                if tuple(full) != tuple(meta.shape):
                    raise InputError(
                        f"{meta.name}: the engine's full shape is {tuple(full)}, the checkpoint's {meta.shape}"
                    )
                exact[meta.name] = per_rank[rank]
    except tpl.TpInfoError as err:
        raise InputError(f"the engine's universal_checkpoint_info: {err}") from None
    layouts = rank_layouts(reader, tp, rank, exact=exact, shapes=shapes)
    return TpShardReader(reader, layouts, tp=tp, rank=rank)
