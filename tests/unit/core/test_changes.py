"""ChangeCounter: waiters wake on a change, time out otherwise, and never miss a bump."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.core.changes import ChangeCounter

pytestmark = pytest.mark.unit


async def test_returns_at_once_when_already_changed() -> None:
    c = ChangeCounter()
    c.bump()
    assert await c.wait_changed(0, 10.0) == 1


async def test_times_out_without_a_change() -> None:
    c = ChangeCounter(5)
    assert await c.wait_changed(5, 0.01) == 5


async def test_many_waiters_wake_on_one_bump_and_timeouts_do_not_block_others() -> None:
    c = ChangeCounter()
    short = [asyncio.create_task(c.wait_changed(0, 0.001)) for _ in range(50)]
    await asyncio.gather(*short)  # cancelled waits leave nothing behind
    waiters = [asyncio.create_task(c.wait_changed(0, 10.0)) for _ in range(50)]
    await asyncio.sleep(0)  # let every waiter capture the event (scheduling, not synchronisation)
    c.bump()
    assert await asyncio.wait_for(asyncio.gather(*waiters), 5.0) == [1] * 50
