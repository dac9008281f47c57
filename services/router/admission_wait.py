"""Waiting for an admission slot: `kvmesh.routing.Admission` decides, `AdmissionGate` parks the waiters.

A request the admission queues cannot run yet waits (at most `queue_timeout_s`) until a release grants it
a slot, the waiting granted by their `priority` (the lowest value first, first come first served within
one); past the timeout it fails with RESOURCE_EXHAUSTED and the queue's retry-after.
"""

from __future__ import annotations

import asyncio
import time

from kvmesh.core.errors import ResourceExhausted
from kvmesh.routing import Admission


class AdmissionGate:
    """`admit` (waits for a slot) and `release` (frees it, waking whoever it grants) around `Admission`."""

    def __init__(self, admission: Admission, queue_timeout_s: float) -> None:
        self.admission = admission
        self.queue_timeout_s = queue_timeout_s
        self._waiters: dict[str, asyncio.Future[None]] = {}

    async def admit(self, rid: str, n_prompt: int, priority: int = 0) -> None:
        """Returns once request `rid` holds a slot; raises ResourceExhausted after `queue_timeout_s`."""
        if self.admission.admit(rid, n_prompt, time.monotonic(), priority):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
        except TimeoutError:
            self._waiters.pop(rid, None)
            self.release(rid)
            raise ResourceExhausted(
                "queued too long", retry_after_s=self.admission.retry_after(self.admission.class_of(n_prompt))
            ) from None
        except BaseException:
            self._waiters.pop(rid, None)
            self.release(rid)
            raise

    def release(self, rid: str) -> None:
        """Frees `rid`'s slot (or its place in a queue) and wakes the requests granted one."""
        for granted in self.admission.release(rid, time.monotonic()):
            f = self._waiters.pop(granted, None)
            if f is not None and not f.done():
                f.set_result(None)
