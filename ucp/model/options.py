"""What a restore is asked to do, as one dataclass: the CLI, the migration YAML and the API all build it.

:class:`RestoreOptions` checks itself once (every problem collected into one message) and is then
planned once against a checkpoint's facts by the target (``ucp.targets.native.plan_native``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ucp.errors import ConfigError
from ucp.model.flavours import FLAVOURS, Flavour
from ucp.model.records import DTYPES, Facts

__all__ = ["Decided", "RestoreOptions", "StepPolicy", "STAGES", "parse_step", "options_with", "zero_label"]

#: ZeRO stages a restore can write (0: DeepSpeed without ZeRO, its default).
STAGES = (0, 1, 2, 3)


def zero_label(stage: int | None) -> str:
    """How a result line names a DeepSpeed stage: ``ZeRO-2``, or ``stage 0 (no ZeRO)``."""
    return "stage 0 (no ZeRO)" if stage == 0 else f"ZeRO-{stage}"


#: ``keep`` each parameter's own step, ``reset`` to 0 (optimizer state dropped on request), or one step for all.
StepPolicy = int | str


def parse_step(step: Any) -> StepPolicy:
    """A step policy from what a user typed (``"7"`` is 7); refuses anything else in one line."""
    if isinstance(step, str) and step.isdigit():
        step = int(step)
    if step is None:
        return "keep"
    if step in ("keep", "reset") or (isinstance(step, int) and not isinstance(step, bool) and step >= 0):
        return step
    raise ConfigError(f"step must be 'keep', 'reset' or a non-negative integer, got {step!r}")


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class RestoreOptions:
    """The new run's layout and optimizer: every choice a native or live restore makes.

    ``None`` means "as the source has it" (optimizer flavour, dtype, sub-group size) or "DeepSpeed's
    default" (tag ``global_step<N>``).
    """

    dp: int
    stage: int = 3
    optimizer: str | None = None
    dtype: str | None = None
    tag: str | None = None
    sub_group_size: int | None = None
    step: StepPolicy = "keep"
    tp: int = 1
    #: the new run offloads its optimizer to CPU (``offload_optimizer``); None: as the source did.
    #: Only DeepSpeed Muon at ZeRO-1/2 lays its state out differently then.
    offload: bool | None = None
    #: the new run sets ``zero_optimization.round_robin_gradients`` (ZeRO-1/2 flatten each group's members in
    #: round-robin order over the ranks); None: as the source did
    round_robin_gradients: bool | None = None
    #: the new run uses ZenFlow (``zero_optimization.zenflow``), which at ZeRO-3 keeps every matrix transposed;
    #: None: as the source did
    zenflow: bool | None = None

    def problems(self) -> list[str]:
        """Everything wrong with these options, each in one line (empty when they are sound)."""
        out = []
        if not _positive(self.dp):
            out.append(f"--dp must be a positive integer, got {self.dp!r}")
        if not _positive(self.tp):
            out.append(f"--tp must be a positive integer, got {self.tp!r}")
        elif self.tp > 1 and self.stage == 3:
            out.append(
                "--tp > 1 needs --stage 0, 1 or 2: DeepSpeed's tensor parallelism (AutoTP) trains with ZeRO stages 0-2"
            )
        if self.stage not in STAGES:
            out.append(f"--stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            out.append(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.optimizer is not None and self.optimizer not in FLAVOURS:
            out.append(f"unknown optimizer flavour {self.optimizer!r}; choose one of {', '.join(FLAVOURS)}")
        try:
            parse_step(self.step)
        except ConfigError as err:
            out.append(str(err))
        if self.sub_group_size is not None and not _positive(self.sub_group_size):
            out.append(f"sub_group_size must be positive, got {self.sub_group_size}")
        if self.offload is not None and not isinstance(self.offload, bool):
            out.append(f"offload must be true or false, got {self.offload!r}")
        if self.round_robin_gradients is not None and not isinstance(self.round_robin_gradients, bool):
            out.append(f"round_robin_gradients must be true or false, got {self.round_robin_gradients!r}")
        if self.zenflow is not None and not isinstance(self.zenflow, bool):
            out.append(f"zenflow must be true or false, got {self.zenflow!r}")
        if self.tag is not None and ("/" in self.tag or self.tag in ("", ".", "..")):
            out.append(f"tag {self.tag!r} is not a folder name")
        return out

    def checked(self) -> RestoreOptions:
        """These options, or a ConfigError listing every problem."""
        problems = self.problems()
        if problems:
            raise ConfigError("; ".join(problems))
        return self

    @property
    def reset(self) -> bool:
        """The optimizer state is dropped and every step starts at 0."""
        return parse_step(self.step) == "reset"

    @property
    def fixed_step(self) -> int | None:
        """The one step every parameter gets, or None when each keeps its own."""
        step = parse_step(self.step)
        return 0 if step == "reset" else None if step == "keep" else int(step)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def options_with(options: RestoreOptions | None, **changes: Any) -> RestoreOptions:
    """A target's options: ``options`` with ``changes`` (keyword fields a caller gave), or those fields alone."""
    if options is None:
        return RestoreOptions(**changes)
    return replace(options, **changes) if changes else options


@dataclass(frozen=True)
class Decided:
    """What a native write settled, for the notes each feature says about it (``ucp.targets.native.plan`` asks every
    feature's note function in turn): the source's facts, the options, and the plan's choices."""

    facts: Facts
    options: RestoreOptions
    flavour: Flavour
    dtype: str
    offload: bool
    #: optimizer state is carried (not reset, and the source holds some)
    has_state: bool
    sub_group_size: int
