"""The errors ucp raises for expected failures: bad input, broken files, refused configs.

The CLI prints ``str(err)`` as one line and exits non-zero; anything that is not a UcpError is a
bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = [
    "UcpError",
    "InputError",
    "CorruptFileError",
    "UnsafeFileError",
    "ChecksumError",
    "ConfigError",
    "OutputExistsError",
    "OutputOverlapError",
    "WriteError",
    "StepConflictError",
    "Stopped",
]


class UcpError(Exception):
    """An expected failure with a message fit for one line of output."""

    exit_code = 2


class InputError(UcpError):
    """The input is not what it claims to be: missing files, mismatched ranks, unsupported layout."""


class CorruptFileError(InputError):
    """A file is truncated, not a torch checkpoint, or its contents contradict its metadata."""


class UnsafeFileError(InputError):
    """A pickle asks for a global outside the allow-list; it is refused, never executed."""


class StepConflictError(InputError):
    """Parameters that one flat optimizer tensor steps together carry different steps."""


class ChecksumError(UcpError):
    """A universal directory's file does not match the checksum its manifest records."""

    exit_code = 1


class ConfigError(UcpError):
    """A migration config or a set of options is invalid; the message lists every problem found."""


class OutputExistsError(UcpError):
    """The output path exists and ``overwrite`` was not given."""


class OutputOverlapError(UcpError):
    """OUT is, lies inside or holds one of the command's inputs: writing it could destroy the input."""


class WriteError(UcpError):
    """The output cannot be written here: no space, over quota, read-only, no permission, a failing disk."""

    exit_code = 3


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C's KeyboardInterrupt so every staged output on the way
    out removes its staging folder; the CLI exits with 128 + the signal's number."""

    def __init__(self, signum: int, name: str) -> None:
        super().__init__(name)
        self.signum = signum
        self.name = name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum
