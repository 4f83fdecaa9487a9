"""Small spans of open files read through a few windows of each file, not one system call each.

A ZeRO-3 rank file holds every parameter's slice back to back, so a writer that walks the parameters in order reads
each source file forward in small steps: at 10^5 parameters, DP 8 and three states, 2.4 million ``preadv`` calls of a
few KB. :class:`ReadAhead` reads :data:`WINDOW` bytes once and copies the spans that fall inside from memory. A span
outside every window of its file takes over the file's least recently used window (a file holds up to
:data:`PER_FILE`: its masters and each optimizer state are read forward at once); a large span, or one whose file
finds no window left under the budget, is read straight, as before. The windows belong to one caller (a thread's
task) and go with it; the files are the reader's, open for as long as the task runs.
"""

from __future__ import annotations

import os

from ucp.model.pieces import FileSpan

__all__ = ["BUDGET", "PER_FILE", "WINDOW", "ReadAhead"]

#: the bytes one window reads at once
WINDOW = 256 << 10
#: windows one file may hold (fp32 masters and two moments read side by side, and one spare)
PER_FILE = 4
#: the bytes of all windows of one :class:`ReadAhead`
BUDGET = 32 << 20


class _Window:
    __slots__ = ("buffer", "end", "start", "used")

    def __init__(self) -> None:
        self.buffer = memoryview(bytearray(WINDOW))
        self.start = self.end = 0  # what the buffer holds: the file's bytes [start, end)
        self.used = 0  # when it last served a read (the caller's count)


class ReadAhead:
    """The windows of one caller; :meth:`read` fills a view with a span's bytes, from a window where it can."""

    def __init__(self, budget: int = BUDGET) -> None:
        self._left = budget // WINDOW  # windows that may still be made
        self._windows: dict[int, list[_Window]] = {}  # by the span's file (id: the files outlive this object)
        self._files: list[object] = []  # the files themselves, so that no id is reused while this object lives
        self._clock = 0

    def read(self, span: FileSpan, out: memoryview) -> None:
        """``out`` (of ``span.nbytes``) filled with the span's bytes."""
        n = span.nbytes
        if n > WINDOW // 4:
            span.read_into(out)
            return
        self._clock += 1
        windows = self._windows.get(id(span.file))
        if windows is None:
            windows = self._windows[id(span.file)] = []
            self._files.append(span.file)
        start = span.offset
        for window in windows:
            if window.start <= start and start + n <= window.end:
                window.used = self._clock
                at = start - window.start
                out[:] = window.buffer[at : at + n]
                return
        if len(windows) < PER_FILE and self._left > 0:
            self._left -= 1
            window = _Window()
            windows.append(window)
        elif windows:
            window = min(windows, key=lambda w: w.used)
        else:  # no window left under the budget for this file
            span.read_into(out)
            return
        got = _pread_some(span, window.buffer)
        window.start, window.end, window.used = start, start + got, self._clock
        if got < n:  # the file ends inside the span: read it straight, which says so
            span.read_into(out)
            return
        out[:] = window.buffer[:n]


def _pread_some(span: FileSpan, buffer: memoryview) -> int:
    """Up to ``len(buffer)`` bytes of the span's file from the span's offset (fewer at the end of the file)."""
    return os.preadv(span.file.fileno(), [buffer], span.offset)
