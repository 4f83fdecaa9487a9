"""The records that flow from a source through the universal format to a target.

A :class:`Reader` is anything that can answer "what is in this checkpoint" (:class:`Facts`) and
"give me one parameter's state" (:meth:`Reader.read`): a DeepSpeed ZeRO checkpoint and a universal
directory are both readers, so every target accepts either. State is named, not Adam-shaped: a
parameter carries its fp32 master and whatever tensors its optimizer keeps, by key.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ucp.model.flavours import check_keys
from ucp.model.hyper import Hyper
from ucp.model.layouts import MegatronRun, RunFolder, SourceLayout
from ucp.model.pieces import Pieces

__all__ = [
    "DTYPES",
    "dtype_name",
    "torch_dtype",
    "ParamMeta",
    "ParamState",
    "PieceState",
    "GroupMeta",
    "SourceInfo",
    "Facts",
    "Reader",
    "Forwarding",
    "ReaderView",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype).replace("torch.", ""))


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


@dataclass(frozen=True, slots=True)
class ParamMeta:
    """One distinct parameter tensor. Tied aliases are not parameters; Facts.tied maps them."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # dtype of the model (low-precision) weight: fp32 | bf16 | fp16
    group: int | None  # param group index; None when frozen
    frozen: bool

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class ParamState:
    """One parameter's full, unpadded state in its real shape.

    ``optim`` holds every per-parameter tensor its optimizer keeps, by the optimizer's own key and
    in its order (``exp_avg``, ``exp_avg_sq`` for Adam; ``momentum_buffer`` for SGD; ...); it is
    empty for a frozen parameter or when the state was not asked for. ``step`` is the number of
    updates applied to the parameter (None: never stepped, frozen, or an optimizer without one).
    ``scalars`` are the optimizer's other 0-dim entries (NAdam's ``mu_product``), exact as kept.
    """

    fp32: torch.Tensor
    optim: dict[str, torch.Tensor] = field(default_factory=dict)
    step: int | None = None
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class PieceState:
    """A :class:`ParamState` whose tensors are :class:`ucp.model.pieces.Pieces`: the copy-free path from
    a source's files into a writer or a target's flat buffers (valid only while the source says so)."""

    fp32: Pieces
    optim: dict[str, Pieces] = field(default_factory=dict)
    step: int | None = None
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def of(cls, state: ParamState) -> PieceState:
        """Whole tensors as one piece each."""
        optim = {k: Pieces.of(v) for k, v in state.optim.items()}
        return cls(fp32=Pieces.of(state.fp32), optim=optim, step=state.step, scalars=dict(state.scalars))

    def joined(self) -> ParamState:
        """The same state as whole fp32 tensors (what :meth:`Reader.read` returns)."""
        return ParamState(
            fp32=self.fp32.join(torch.float32),
            optim={k: v.join(torch.float32) for k, v in self.optim.items()},
            step=self.step,
            scalars=dict(self.scalars),
        )


@dataclass
class GroupMeta:
    """A param group: neutral hyperparameters, the source's own keys, and its members in order."""

    index: int
    hyper: Hyper
    raw: dict[str, Any]
    params: list[str]
    step: int | None = None
    #: what the optimizer keeps per member parameter, besides the step (empty: no state yet)
    state_keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class SourceInfo:
    """Facts about where a checkpoint came from, kept in ucp.json for every later stage."""

    format: str  # deepspeed | universal
    zero_stage: int
    dp_world_size: int
    mp_world_size: int = 1
    dtype: str = "fp32"
    ds_version: str | None = None
    tag: str | None = None
    sub_group_size: int | None = None
    global_steps: int = 0
    skipped_steps: int = 0
    global_samples: int | None = None
    iteration: int | None = None
    ds_config: dict[str, Any] = field(default_factory=dict)
    #: saved with exclude_frozen_parameters: the frozen weights are not in it (a restore keeps the new run's)
    frozen_excluded: bool = False
    #: copies of the partitioned state the run kept: a MiCS run shards over dp_world_size ranks (its files)
    #: and has replicas x dp_world_size ranks; 1 otherwise
    replicas: int = 1

    @property
    def batch_ranks(self) -> int:
        """The ranks that each took a micro-batch: what the global batch is counted over."""
        return self.dp_world_size * self.replicas


@dataclass(frozen=True)
class Facts:
    """Everything about a checkpoint except the tensors themselves."""

    info: SourceInfo
    flavour: str | None  # None: unknown (the optimizer never stepped, or no known layout)
    adam_w_mode: bool | None
    step: int | None
    groups: list[GroupMeta]
    params: list[ParamMeta]  # flat order: optimized params group by group, then frozen ones
    tied: dict[str, str] = field(default_factory=dict)  # alias -> parameter that holds the data
    buffer_names: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: per parameter, how tensor parallelism lays it out (ucp.model.tp.TpRule as JSON); empty when the
    #: source had no tensor parallelism and no rules were given
    tp_rules: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: a composite source's pipeline stages, MoE or AutoEP layers (None: one flat model)
    layout: SourceLayout | None = None
    #: the training framework's run folder the checkpoint came in (a Trainer or Accelerate folder), if any
    folder: RunFolder | None = None
    #: a Megatron-LM run's config and the unsharded rest of its checkpoint, for a Megatron target (None: not one)
    megatron: MegatronRun | None = None

    def __post_init__(self) -> None:
        # every source's facts pass here: state its flavour does not keep is refused, never carried as Adam's
        check_keys(self.flavour, {k for g in self.groups for k in g.state_keys})

    def param(self, name: str) -> ParamMeta:
        return self._by_name[name]

    @cached_property
    def _by_name(self) -> dict[str, ParamMeta]:
        """Each name's first entry, indexed once: a target looks every parameter up (10^5 of them in a MoE)."""
        index: dict[str, ParamMeta] = {}
        for meta in self.params:
            index.setdefault(meta.name, meta)
        return index


class Reader(ABC):
    """What every source offers, and what every target and operation takes.

    Call order: :attr:`facts` any time (built once, never changed: a wrapper that changes them is a
    new reader); :meth:`read` or :meth:`read_pieces` per parameter, in any order and from several
    threads; :meth:`buffers` and :meth:`extras` once; then :meth:`close` (or use ``with``).
    """

    facts: Facts
    #: the files and folders the reader reads (set by :func:`ucp.sources.open_reader`): what no output of a
    #: writer handed this reader may be, lie inside or hold (``ucp.io.guard``); empty for a reader over no files
    inputs: tuple[Path, ...] = ()
    #: the source format it was opened as (a name of ``ucp.sources.registry``); "" for a reader built by hand
    format: str = ""
    #: True when :meth:`read_pieces` hands out spans of files rather than whole tensors, valid until
    #: :meth:`close` (not just inside the ``with`` block): a target then streams each rank's share
    #: from them into its files, holding spans, never the data.
    streams: bool = False

    @abstractmethod
    def read(self, name: str, *, moments: bool = True) -> ParamState:
        """One parameter's full state; ``moments=False`` leaves ``optim`` empty."""

    @contextmanager
    def read_pieces(self, name: str, *, moments: bool = True) -> Iterator[PieceState]:
        """:meth:`read` as pieces, valid inside the ``with`` block. Sources that can hand out spans of
        their files override it; by default it wraps :meth:`read`'s whole tensors."""
        yield PieceState.of(self.read(name, moments=moments))

    def deferred_checks(self, elsewhere: Callable[[str], bool] | None = None) -> AbstractContextManager[None]:
        """A block inside which the reader may hand out spans of files it has not checked yet, and
        checks them (from what writers copied) when the block ends, raising there on a mismatch:
        a streaming writer wraps its work in it so each byte is read once. ``elsewhere(name)``:
        the parameters another process checks (a distributed write splits the checking too).
        Readers that check nothing lazily keep this no-op."""
        return nullcontext()

    def param_steps(self) -> dict[str, int | None]:
        """Each parameter's step as the checkpoint records it, without reading any tensor: a source
        knows its group's step; a universal directory records one per parameter."""
        group_step = {g.index: g.step for g in self.facts.groups}
        return {p.name: (None if p.frozen or p.group is None else group_step.get(p.group)) for p in self.facts.params}

    @abstractmethod
    def buffers(self) -> dict[str, torch.Tensor]:
        """The persistent buffers, by name."""

    @abstractmethod
    def extras(self) -> dict[str, Any]:
        """Scheduler, sampler, client state and loss-scaler fields."""

    def close(self) -> None:
        """Release the files; the reader is unusable afterwards. Readers that hold none keep this no-op."""
        return None

    def mark_source(self, format: str, inputs: tuple[Path, ...]) -> None:
        """What the registry that opened the reader knows of it: its format's name and the paths it reads."""
        self.format, self.inputs = format, inputs

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Forwarding(Reader):
    """A reader over an ``inner`` one: the files it reads and the format it was opened as are the inner reader's."""

    inner: Reader

    @property
    def inputs(self) -> tuple[Path, ...]:  # type: ignore[override]  # a view reads its inner reader's files
        return self.inner.inputs

    @property
    def format(self) -> str:  # type: ignore[override]
        return self.inner.format

    def mark_source(self, format: str, inputs: tuple[Path, ...]) -> None:
        self.inner.mark_source(format, inputs)


class ReaderView(Forwarding):
    """Another reader seen with other facts (rules added, parameters cut for one TP rank, ...).

    Everything it does not override goes to the inner reader, streaming included; closing a view
    leaves the inner reader open (its owner closes it), unless the view ``owns`` it (a source that hands out the
    view closes its reader through it).
    """

    _owns = False

    def __init__(self, inner: Reader, facts: Facts, *, owns: bool = False) -> None:
        self.inner = inner
        self.facts = facts
        self.streams = inner.streams
        self._owns = owns

    def read(self, name: str, *, moments: bool = True) -> ParamState:
        return self.inner.read(name, moments=moments)

    def reads_whole(self, name: str) -> bool:
        """The view changes ``name``'s tensors: :meth:`read_pieces` gives :meth:`read`'s whole ones, not the inner
        reader's spans. By default it changes none."""
        return False

    @contextmanager
    def read_pieces(self, name: str, *, moments: bool = True) -> Iterator[PieceState]:
        if self.reads_whole(name):
            yield PieceState.of(self.read(name, moments=moments))
            return
        with self.inner.read_pieces(name, moments=moments) as state:
            yield state

    def deferred_checks(self, elsewhere: Callable[[str], bool] | None = None) -> AbstractContextManager[None]:
        return self.inner.deferred_checks(elsewhere)

    def param_steps(self) -> dict[str, int | None]:
        return self.inner.param_steps()

    def buffers(self) -> dict[str, torch.Tensor]:
        return self.inner.buffers()

    def extras(self) -> dict[str, Any]:
        return self.inner.extras()

    def close(self) -> None:
        if self._owns:
            self.inner.close()
