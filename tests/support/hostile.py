"""A pickle that asks to run code: if ucp's readers ever run it, ``CALLS`` shows it."""

from __future__ import annotations

CALLS: list[str] = []


def record_call(note: str) -> str:
    """What a hostile pickle asks to run; if it ever runs, CALLS shows it."""
    CALLS.append(note)
    return note


class Hostile:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return record_call, ("pwned",)
