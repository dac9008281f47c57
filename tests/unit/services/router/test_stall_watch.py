"""The router's stall watch cancels a silent attempt only when another worker could take the request."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.routing.stall import StallConfig, WorkerLatency
from kvmesh.services.router.stall_watch import StallWatch

# a worker without samples gets the ceiling as its bound: 10 ms here, so each check comes quickly
CFG = StallConfig(ttft_floor_s=0.01, ttft_ceiling_s=0.01)


async def _wait_on(watch: StallWatch, never: asyncio.Event) -> None:
    watch.arm()
    await never.wait()  # the worker sends nothing


async def test_a_silent_attempt_is_cancelled_as_stalled_when_another_worker_is_routable() -> None:
    watch = StallWatch(CFG, WorkerLatency(), 100, lambda: float("-inf"), lambda: True)
    task = asyncio.create_task(_wait_on(watch, asyncio.Event()))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert watch.fired


async def test_a_silent_attempt_waits_while_no_other_worker_could_take_it() -> None:
    checks: list[bool] = []

    def elsewhere() -> bool:  # no other worker for the first two checks, then one comes back
        checks.append(len(checks) >= 2)
        return checks[-1]

    watch = StallWatch(CFG, WorkerLatency(), 100, lambda: float("-inf"), elsewhere)
    task = asyncio.create_task(_wait_on(watch, asyncio.Event()))
    with pytest.raises(asyncio.CancelledError):
        await task
    assert checks == [False, False, True]  # cancelled only once another worker was routable
    assert watch.fired
