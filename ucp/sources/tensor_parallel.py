"""A tensor-parallel DeepSpeed checkpoint (``mp_rank_XX`` files) -> one reader of full parameters.

Each TP rank's files form an ordinary ZeRO checkpoint of that rank's shards; one per-rank reader
(ZeRO-1/2 or ZeRO-3) reads each. This reader merges their shards parameter by parameter with the
rules of :mod:`ucp.model.tp`, taken from DeepSpeed's ``universal_checkpoint_info`` (AutoTP and
Megatron-DeepSpeed write it into the model-states files) or from rules the caller gives (the
migration YAML), which win over the checkpoint's. An affine map in the info gives exact per-rank
layouts; otherwise the layouts follow from the rules, and are checked against every rank's shapes.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from ucp.deepspeed.fields import MALFORMED, first_line
from ucp.deepspeed.layout import CheckpointFiles
from ucp.errors import InputError
from ucp.io.torchfile import TorchFile
from ucp.model import tp as tpl
from ucp.model.records import Facts, ParamMeta, ParamState, Reader, ReaderView
from ucp.sources.format import How, Probe, SourceFormat

__all__ = [
    "FORMAT",
    "TensorParallelSource",
    "checkpoint_tp_info",
    "given_rules",
    "with_tp_rules",
    "rank_layouts_of",
    "merge_shards",
    "rules_for",
]

logger = logging.getLogger(__name__)

#: The key DeepSpeed stores the conversion schema under, in model-states (and ZeRO-1/2 optim) files.
INFO_KEY = "universal_checkpoint_info"

#: What a damaged or hand-edited ``universal_checkpoint_info`` can raise on its way through ucp.model.tp
#: (a bad regex, a list where a mapping belongs, a missing key): one line, never a traceback.
_BAD_INFO = (tpl.TpInfoError, re.error) + MALFORMED


def checkpoint_tp_info(files: CheckpointFiles) -> dict[str, Any]:
    """``universal_checkpoint_info`` from mp rank 0's model-states file ({} when absent)."""
    tf = TorchFile(files.model[0][0])
    try:
        obj = tf.obj
        info = obj.get(INFO_KEY) if isinstance(obj, Mapping) else None
    finally:
        tf.close()
    if info is None:
        return {}
    if not isinstance(info, Mapping):
        raise InputError(f"{files.model[0][0].name}: {INFO_KEY} is a {type(info).__name__}, not a mapping")
    return dict(info)


def _rank_reader(files: CheckpointFiles, mp_rank: int, optimizer: str | None) -> Reader:
    if files.stage3:
        from ucp.sources.zero3 import Zero3Source

        return Zero3Source(files, optimizer=optimizer, mp_rank=mp_rank)
    from ucp.sources.zero12 import Zero12Source

    return Zero12Source(files, optimizer=optimizer, mp_rank=mp_rank)


def given_rules(patterns: Sequence[tuple[str, tpl.TpRule]], names: Sequence[str]) -> dict[str, tpl.TpRule]:
    """Rules for ``names`` from (regex, rule) pairs, first match wins (the migration YAML's form)."""
    out = {}
    for name in names:
        for pattern, rule in patterns:
            if re.match(pattern, name):
                out[name] = rule
                break
    return out


def with_tp_rules(reader: Reader, patterns: Sequence[tuple[str, tpl.TpRule]]) -> Reader:
    """The reader seen with given rules recorded (a source without TP, or a universal directory), so a
    target can cut its full parameters for a TP degree. A merged TP source applied them already."""
    if isinstance(reader, TensorParallelSource) or not patterns:
        return reader
    rules = dict(reader.facts.tp_rules)
    rules.update({n: r.to_json() for n, r in given_rules(patterns, [m.name for m in reader.facts.params]).items()})
    return ReaderView(reader, replace(reader.facts, tp_rules=rules))


def rules_for(
    info: Mapping[str, Any],
    shapes: Mapping[str, Sequence[Sequence[int]]],
    given: Sequence[tuple[str, tpl.TpRule]],
    where: str,
) -> dict[str, tpl.TpRule]:
    """Each named tensor's rule, from its TP ranks' shapes: the checkpoint's ``universal_checkpoint_info``
    (when it has one), overridden by given (regex, rule) pairs; a name neither covers has none."""
    try:
        rules = tpl.rules_from_info(info, shapes) if info else {}
    except _BAD_INFO as err:
        raise InputError(f"{where}: {INFO_KEY}: {err}") from None
    rules.update(given_rules(given, list(shapes)))
    return rules


def rank_layouts_of(
    info: Mapping[str, Any], name: str, rule: tpl.TpRule, shapes: Sequence[Sequence[int]], where: str
) -> tuple[tuple[int, ...], list[tpl.RankLayout]]:
    """(full shape, per-rank layouts) of one parameter saved at TP=len(shapes): the info's affine map
    when it names the parameter, else the rule; each rank's shard shape is checked against them."""
    tp = len(shapes)
    try:
        affine = tpl.affine_layouts(info, name, tp) if info else None
        if affine is not None:
            full, layouts = affine
        else:
            full = tpl.full_shape(rule, shapes)
            layouts = tpl.layouts_for(rule, full, tp)
    except _BAD_INFO as err:
        raise InputError(f"{where}: {INFO_KEY}: {first_line(err)}") from None
    for r, (shape, layout) in enumerate(zip(shapes, layouts)):
        if tuple(shape) != tuple(layout.shard_shape):
            raise InputError(
                f"{where}: TP rank {r} holds shape {tuple(shape)}, but its rule "
                f"{rule.to_json()} gives {tuple(layout.shard_shape)} at TP={tp}"
            )
    return full, layouts


def merge_shards(
    shards: Sequence[torch.Tensor], layouts: Sequence[tpl.RankLayout], full: Sequence[int], where: str
) -> torch.Tensor:
    """The full tensor from the TP ranks' shards (a replicated one from rank 0's copy alone)."""
    try:
        return tpl.gather(list(shards), list(layouts[: len(shards)]), full)
    except tpl.TpInfoError as err:
        raise InputError(f"{where}: {err}") from None


class TensorParallelSource(Reader):
    """A ZeRO checkpoint saved at TP degree > 1, read as full parameters.

    ``mp_ranks`` and ``rank_reader`` name the mp ranks that make up the model and how to read one
    (every mp rank of the folder, each by its ZeRO stage's reader, unless given: a pipeline stage
    passes its own TP ranks)."""

    def __init__(
        self,
        files: CheckpointFiles,
        *,
        optimizer: str | None = None,
        rules: Sequence[tuple[str, tpl.TpRule]] = (),
        mp_ranks: Sequence[int] | None = None,
        rank_reader: Callable[[int], Reader] | None = None,
    ) -> None:
        self.files = files
        mp_ranks = list(range(files.mp) if mp_ranks is None else mp_ranks)
        self.tp = len(mp_ranks)
        self._ranks: list[Reader] = []
        try:
            for mp_rank in mp_ranks:
                self._ranks.append(
                    _rank_reader(files, mp_rank, optimizer) if rank_reader is None else rank_reader(mp_rank)
                )
            self.info = checkpoint_tp_info(files)
            self.facts = self._facts(rules)
        except BaseException:
            self.close()
            raise

    def _facts(self, given: Sequence[tuple[str, tpl.TpRule]]) -> Facts:
        first = self._ranks[0].facts
        names = [m.name for m in first.params]
        for r, reader in enumerate(self._ranks[1:], 1):
            # DeepSpeed 0.19.8 records shared_params on TP rank 0 only: elsewhere a tied alias looks
            # like a frozen parameter of its own. Rank 0's view of the ties stands.
            theirs = [m.name for m in reader.facts.params if m.name not in first.tied]
            if theirs != names:
                odd = sorted(set(theirs) ^ set(names))[:3]
                raise InputError(
                    f"{self.files.tag_dir}: TP rank {r} holds other parameters than rank 0 ({odd}); "
                    "the mp_rank files are not one run"
                )
        shapes = {n: [reader.facts.param(n).shape for reader in self._ranks] for n in names}
        rules = rules_for(self.info, shapes, given, str(self.files.tag_dir))
        missing = [n for n in names if n not in rules]
        if missing:
            raise InputError(
                f"{self.files.tag_dir} has {self.tp} tensor-parallel ranks but no rule for {missing[0]!r} "
                f"({len(missing)} parameters): the checkpoint carries no {INFO_KEY}; give the rules "
                "in the migration YAML (tensor_parallel.rules)"
            )
        self.rules: dict[str, tpl.TpRule] = {}
        self.layouts: dict[str, list[tpl.RankLayout]] = {}
        params = []
        for meta in first.params:
            rule = rules[meta.name]
            if rule.vocab is not None and rule.padded is None:
                rule = replace(rule, padded=sum(s[0] for s in shapes[meta.name]))
            self.rules[meta.name] = rule
            full, layouts = rank_layouts_of(
                self.info, meta.name, rule, shapes[meta.name], f"{self.files.tag_dir}: {meta.name}"
            )
            self.layouts[meta.name] = layouts
            params.append(ParamMeta(meta.name, full, meta.dtype, meta.group, meta.frozen))
        info = replace(first.info, mp_world_size=self.tp)
        return replace(first, info=info, params=params, tp_rules={n: r.to_json() for n, r in self.rules.items()})

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        layouts = self.layouts[name]
        # a replicated tensor is whole on every rank: rank 0's copy is the tensor (an embedding is
        # often the largest parameter; reading it T times would cost T x its bytes)
        holders = self._ranks[:1] if layouts[0].replicated and not layouts[0].average else self._ranks
        states = [reader.read(name, moments=moments) for reader in holders]
        full = self.facts.param(name).shape
        steps = {s.step for s in states}
        if len(steps) > 1:
            logger.warning("%s: TP ranks hold steps %s; using rank 0's", name, sorted(map(str, steps)))

        keys = list(states[0].optim)
        if any(list(s.optim) != keys for s in states[1:]):
            raise InputError(
                f"{self.files.tag_dir}: {name}: TP ranks hold different optimizer state "
                f"{sorted({tuple(s.optim) for s in states})}"
            )

        def merge(shards: list[torch.Tensor]) -> torch.Tensor:
            return merge_shards(shards, layouts, full, f"{self.files.tag_dir}: {name}")

        return ParamState(
            fp32=merge([s.fp32 for s in states]),
            optim={k: merge([s.optim[k] for s in states]) for k in keys},
            step=states[0].step,
            scalars=states[0].scalars,  # TP ranks step together: one value (the ZeRO source checked its ranks)
        )

    def buffers(self) -> dict[str, torch.Tensor]:
        return self._ranks[0].buffers()

    def extras(self) -> dict[str, Any]:
        return self._ranks[0].extras()

    def close(self) -> None:
        for reader in self._ranks:
            reader.close()


def _claims_tp(probe: Probe) -> bool:
    files = probe.deepspeed
    return files is not None and files.mp > 1 and not (files.layers or files.experts) and not probe.autoep


def _open_tp(probe: Probe, how: How) -> Reader:
    """Every mp rank by its stage's reader (stage 0's own, which takes ``frozen``), merged by the rules."""
    files = probe.deepspeed
    assert files is not None  # claimed
    if not files.stage0:
        if how.frozen:
            raise InputError(
                f"frozen parameters are named only for a DCP folder or a stage-0 checkpoint; {probe.path} is a ZeRO "
                "checkpoint, which lists its own"
            )
        return TensorParallelSource(files, optimizer=how.optimizer, rules=how.tp_rules)
    from ucp.sources.zero0 import Zero0Source

    def rank_reader(mp_rank: int) -> Reader:
        return Zero0Source(files, optimizer=how.optimizer, frozen=how.frozen, mp_rank=mp_rank)

    return TensorParallelSource(files, rules=how.tp_rules, rank_reader=rank_reader)


FORMAT = SourceFormat(
    name="deepspeed-tp",
    label="DeepSpeed tensor-parallel checkpoint (AutoTP, Megatron-DeepSpeed)",
    docs="format.md#3-tensor-parallelism-deepspeed-autotp-megatron-deepspeed",
    claims=_claims_tp,
    open=_open_tp,
    family="deepspeed",
    takes=frozenset({"frozen"}),
)
