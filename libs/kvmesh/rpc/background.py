"""Background tasks a service runs besides its servers: periodic and supervised, stopped in order.

`BackgroundTasks.every(interval_s, fn)` awaits `fn()` every `interval_s` seconds; an exception is logged and
counted (`failures[name]`) and the loop carries on. `BackgroundTasks.supervise(coro_fn)` runs `coro_fn()` and,
when it crashes, runs it again after a bounded exponential back-off (`restarts[name]` counts them); returning
normally ends it. `stop()` sets `stopping` and stops the tasks with `kvmesh.core.tasks.stop_task`, last started
first, so a task never outlives one it depends on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from kvmesh.core.tasks import stop_task

log = logging.getLogger(__name__)

Job = Callable[[], Awaitable[object]]


class BackgroundTasks:
    """The named background tasks of one process (see the module docstring)."""

    def __init__(
        self, stopping: asyncio.Event | None = None, backoff_min_s: float = 0.05, backoff_max_s: float = 5.0
    ) -> None:
        self.stopping = stopping or asyncio.Event()
        self.backoff_min_s = backoff_min_s
        self.backoff_max_s = backoff_max_s
        self.failures: Counter[str] = Counter()  # periodic runs that raised, by name
        self.restarts: Counter[str] = Counter()  # supervised restarts after a crash, by name
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def every(self, interval_s: float, fn: Job, *, name: str) -> asyncio.Task[None] | None:
        """Runs `await fn()` every `interval_s` seconds until stopped; `interval_s <= 0` runs nothing."""
        if interval_s <= 0:
            return None
        return self._spawn(name, self._every(interval_s, fn, name))

    def supervise(self, coro_fn: Job, *, name: str) -> asyncio.Task[None]:
        """Runs `await coro_fn()`, restarted with bounded back-off whenever it raises, until stopped."""
        return self._spawn(name, self._supervise(coro_fn, name))

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Sets `stopping` and stops every task, the last started first."""
        self.stopping.set()
        for name in reversed(list(self.tasks)):
            await stop_task(self.tasks.pop(name), timeout_s)

    def _spawn(self, name: str, coro: Awaitable[None]) -> asyncio.Task[None]:
        if name in self.tasks:
            raise ValueError(f"a background task named {name!r} already runs")
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        task.set_name(name)
        self.tasks[name] = task
        return task

    async def _wait_stopping(self, seconds: float) -> bool:
        """Waits `seconds` or until stopping; True if stopping."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), seconds)
        return self.stopping.is_set()

    async def _every(self, interval_s: float, fn: Job, name: str) -> None:
        while not await self._wait_stopping(interval_s):
            try:
                await fn()
            except Exception:
                self.failures[name] += 1
                log.exception("periodic task %s failed", name)

    async def _supervise(self, coro_fn: Job, name: str) -> None:
        backoff = self.backoff_min_s
        while not self.stopping.is_set():
            try:
                await coro_fn()
                return
            except Exception:
                self.restarts[name] += 1
                log.exception("task %s crashed; restarting in %.2fs", name, backoff)
            if await self._wait_stopping(backoff):
                return
            backoff = min(backoff * 2, self.backoff_max_s)
