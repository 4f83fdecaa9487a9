"""SIGTERM, SIGHUP and Ctrl-C stop a command the same way: an exception in the main thread.

The exception (:class:`ucp.errors.Stopped`, a KeyboardInterrupt) unwinds through every
``with staged_output(...)``, which removes its staging folder; the CLI then prints one line and
exits with 128 + the signal's number. A signal that arrives while that clean-up runs is noted and
ignored, so it cannot cut the clean-up short. Installed once, by the CLI's entry point.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from ucp.errors import Stopped

__all__ = ["stop_on_signals", "held_signals", "STOP_SIGNALS", "raise_if_stopped", "stopped_by"]

logger = logging.getLogger(__name__)

#: the signals that stop a command cleanly (SIGKILL cannot be caught: see staged_output for why it is safe too)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


#: the signals received inside stop_on_signals, first one first (a library may swallow the exception)
_RECEIVED: list[int] = []
#: a stop noted inside importlib's clean-up, raised on its re-delivery unless raise_if_stopped raised it first
_DEFERRED: list[int] = []


def stopped_by() -> int | None:
    """The first stop signal received, or None: the exception it raised may have been swallowed by
    a library (a bare ``except:`` in an import), so the command must still end as stopped."""
    return _RECEIVED[0] if _RECEIVED else None


def raise_if_stopped() -> None:
    """Raise :class:`Stopped` again if a stop signal came: called before an output is published."""
    signum = stopped_by()
    if signum is not None:
        # raised now: its re-delivery must not raise it again inside the clean-up this starts (it did, inside
        # shutil.rmtree, which then failed closing a file descriptor twice)
        _DEFERRED.clear()
        raise Stopped(signum, signal.Signals(signum).name)


@contextlib.contextmanager
def held_signals(signums: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[list[int]]:
    """Within the block stop signals are only noted (the yielded list), never raised: for imports of
    C extensions, which an exception in mid-import leaves broken for the rest of the process (numpy
    then fails with "cannot load module more than once"). Outside the main thread this notes nothing."""
    got: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    previous = {signum: signal.signal(signum, lambda n, f: got.append(n)) for signum in signums}
    try:
        yield got
    finally:
        for number, old in previous.items():
            signal.signal(number, old)


def _in_import_machinery(frame: FrameType | None) -> bool:
    """The main thread was interrupted inside importlib's own code (where an exception is lost)."""
    return frame is not None and frame.f_code.co_filename.startswith("<frozen importlib")


def _send_again(signum: int, active: threading.Event) -> None:
    """Deliver ``signum`` to this process again in 10 ms, while ``active`` (the handler still installed)."""

    def send() -> None:
        if active.is_set():
            os.kill(os.getpid(), signum)

    timer = threading.Timer(0.01, send)
    timer.daemon = True
    timer.start()


@contextlib.contextmanager
def stop_on_signals(signums: tuple[signal.Signals, ...] = STOP_SIGNALS, *, then_ignore: bool = False) -> Iterator[None]:
    """Within the block the first of ``signums`` raises :class:`Stopped`; later ones are ignored.

    The previous handlers come back on leaving, or with ``then_ignore`` the signals stay ignored: for
    a process that only exits after the block, whose output a late signal can no longer change.
    Outside the main thread (where Python cannot set handlers) this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _RECEIVED.clear()
    _DEFERRED.clear()
    deferred = _DEFERRED  # a stop noted inside importlib's clean-up, raised on the next delivery
    active = threading.Event()  # this handler is installed (a late re-delivery must not reach the default one)

    def handler(signum: int, frame: FrameType | None) -> None:
        if _in_import_machinery(frame):
            # an exception here (a module lock's weakref callback) is printed and dropped by Python:
            # note the stop and deliver the signal again a moment later, outside the callback
            if not _RECEIVED:
                _RECEIVED.append(signum)
                deferred.append(signum)
            if deferred:
                _send_again(deferred[0], active)
            return
        if deferred:
            first = deferred.pop()
            raise Stopped(first, signal.Signals(first).name)
        if _RECEIVED:  # already stopping: let the clean-up finish
            logger.info("ignoring %s while cleaning up", signal.Signals(signum).name)
            return
        _RECEIVED.append(signum)
        raise Stopped(signum, signal.Signals(signum).name)

    previous: dict[int, Any] = {}
    try:
        for signum in signums:
            previous[signum] = signal.signal(signum, handler)
        active.set()
        yield
    finally:
        active.clear()
        for number, old in previous.items():
            signal.signal(number, signal.SIG_IGN if then_ignore else old)
        # the stop has been handled: a later call in this process (the API after an interrupted CLI call in a
        # notebook, the next test) must not find it and raise it again before publishing
        _RECEIVED.clear()
        _DEFERRED.clear()
