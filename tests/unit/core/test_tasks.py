"""stop_task ends a background loop even when one cancellation is swallowed, and never hangs."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.core.tasks import stop_task

pytestmark = pytest.mark.unit


async def test_stops_a_loop_that_swallows_one_cancellation() -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed == 0:  # what a racing asyncio.wait_for can do in Python 3.11
                    swallowed += 1
                    continue
                raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await stop_task(task, timeout_s=5.0)
    assert task.cancelled() and swallowed == 1


async def test_gives_up_after_the_timeout_instead_of_hanging() -> None:
    release = asyncio.Event()

    async def stubborn_until_released() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if release.is_set():
                    raise

    task = asyncio.create_task(stubborn_until_released())
    await asyncio.sleep(0)
    await stop_task(task, timeout_s=0.3)
    assert not task.done()  # gave up instead of hanging
    release.set()
    await stop_task(task, timeout_s=5.0)
    assert task.cancelled()


async def test_none_and_finished_tasks() -> None:
    await stop_task(None)
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    await stop_task(done)
