"""`AdmissionGate`: a request that cannot run yet waits, and a release wakes the one its `priority` puts first
(the lowest value; arrival order within one)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.routing import Admission, QueueLimits
from kvmesh.services.router.admission_wait import AdmissionGate

pytestmark = pytest.mark.unit


async def test_a_release_wakes_the_waiter_with_the_lowest_priority_value() -> None:
    gate = AdmissionGate(Admission(short=QueueLimits(1, 4), long=QueueLimits(1, 1)), queue_timeout_s=10.0)
    await gate.admit("running", 1)
    waiters = {rid: asyncio.ensure_future(gate.admit(rid, 1, prio)) for rid, prio in (("late", 3), ("urgent", -2))}
    for _ in range(3):  # both parked (a bounded number of loop turns, no sleep)
        await asyncio.sleep(0)
    assert gate.admission.stats()["short"] == {"running": 1, "waiting": 2}
    gate.release("running")
    done, _ = await asyncio.wait(waiters.values(), timeout=5.0, return_when=asyncio.FIRST_COMPLETED)
    assert done == {waiters["urgent"]} and not waiters["late"].done()
    gate.release("urgent")
    await asyncio.wait_for(waiters["late"], 5.0)
    gate.release("late")
    assert gate.admission.stats()["short"] == {"running": 0, "waiting": 0}
