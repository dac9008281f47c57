"""`ChangeCounter`: a version number that asyncio tasks can wait on, without locks.

Publishers call `bump()`; waiters call `await wait_changed(seen, timeout_s)`, which returns as soon as the
version differs from `seen` (at once if it already does) or when the timeout passes. One `asyncio.Event` per
version is set and replaced on every bump, so a waiter that captured the event can never miss a change, and a
timeout cancels nothing but its own wait (no lock to reacquire under cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib


class ChangeCounter:
    """A monotonically increasing version with lock-free waiting (see the module docstring)."""

    def __init__(self, start: int = 0) -> None:
        self.value = start
        self._event = asyncio.Event()

    def bump(self) -> int:
        """Advances the version and wakes every waiter."""
        self.value += 1
        event, self._event = self._event, asyncio.Event()
        event.set()
        return self.value

    async def wait_changed(self, seen: int, timeout_s: float) -> int:
        """Waits until the version differs from `seen` or `timeout_s` passes; returns the current version."""
        if self.value != seen or timeout_s <= 0:
            return self.value
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout_s)
        return self.value
