"""Stopping background asyncio tasks reliably.

`task.cancel(); await task` can wait forever: in Python 3.11 `asyncio.wait_for` may swallow a cancellation
that races with its inner future's completion, and a `while True` task then just carries on. `stop_task`
re-cancels until the task ends, bounded by a timeout, so a shutdown never hangs on one background loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

log = logging.getLogger(__name__)


async def stop_task(task: asyncio.Task[Any] | None, timeout_s: float = 5.0) -> None:
    """Cancels `task` and waits (at most `timeout_s`) for it to end, re-cancelling every 100 ms."""
    if task is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not task.done():
        task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            log.warning("task %s did not stop within %.1fs", task.get_name(), timeout_s)
            return
        await asyncio.wait({task}, timeout=min(0.1, left))
    if not task.cancelled():
        with contextlib.suppress(Exception):
            task.result()  # retrieve it, so a failure is not reported as "never retrieved"
