"""The skeleton's background work: periodic tasks survive errors, supervised ones restart, registration retries."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from kvmesh.core.errors import Unavailable
from kvmesh.discovery.model import Role, ServiceInstance
from kvmesh.discovery.registration import register_until_done, self_instance
from kvmesh.discovery.registry import CheckSpec, HealthProbe, Registry
from kvmesh.rpc.background import BackgroundTasks

pytestmark = pytest.mark.unit

BOUND_S = 10.0  # every wait below is bounded by this


async def test_periodic_task_survives_an_exception_and_stops_on_shutdown() -> None:
    bg = BackgroundTasks()
    runs = 0
    third = asyncio.Event()

    async def tick() -> None:
        nonlocal runs
        runs += 1
        if runs == 1:
            raise RuntimeError("first run fails")
        if runs == 3:
            third.set()

    task = bg.every(0.001, tick, name="tick")
    await asyncio.wait_for(third.wait(), BOUND_S)
    assert bg.failures["tick"] == 1
    await bg.stop()
    assert task is not None and task.done() and bg.stopping.is_set() and not bg.tasks


async def test_periodic_task_with_zero_interval_is_off() -> None:
    bg = BackgroundTasks()
    assert bg.every(0, lambda: asyncio.sleep(0), name="off") is None and not bg.tasks


async def test_supervised_task_restarts_after_a_crash() -> None:
    bg = BackgroundTasks(backoff_min_s=0.001)
    starts = 0
    running = asyncio.Event()

    async def work() -> None:
        nonlocal starts
        starts += 1
        if starts < 3:
            raise RuntimeError(f"crash {starts}")
        running.set()
        await asyncio.Event().wait()  # runs until stopped

    bg.supervise(work, name="work")
    await asyncio.wait_for(running.wait(), BOUND_S)
    assert starts == 3 and bg.restarts["work"] == 2
    await bg.stop()
    assert not bg.tasks


async def test_tasks_stop_last_started_first() -> None:
    bg = BackgroundTasks()
    order: list[str] = []
    started = {n: asyncio.Event() for n in ("first", "second")}

    def job(name: str):  # type: ignore[no-untyped-def]
        async def run() -> None:
            started[name].set()
            try:
                await asyncio.Event().wait()
            finally:
                order.append(name)

        return run

    bg.supervise(job("first"), name="first")
    bg.supervise(job("second"), name="second")
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), BOUND_S)
    await bg.stop()
    assert order == ["second", "first"]


class FlakyRegistry:
    """Refuses the first `failures` registrations, then answers."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0
        self.registered: list[ServiceInstance] = []

    async def register(self, instance: ServiceInstance, check: CheckSpec, probe: HealthProbe | None = None) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise Unavailable("registry down")
        self.registered.append(instance)


def _me() -> ServiceInstance:
    return self_instance(instance_id="w1", role=Role.WORKER, zone="a", version="v1", address="127.0.0.1:5000")


async def test_registration_retries_until_the_registry_answers() -> None:
    reg = FlakyRegistry(failures=3)
    ok = await asyncio.wait_for(
        register_until_done(cast(Registry, reg), _me(), CheckSpec(), None, asyncio.Event(), backoff_min_s=0.001),
        BOUND_S,
    )
    assert ok and reg.calls == 4 and [i.id for i in reg.registered] == ["w1"]
    assert reg.registered[0].target == "127.0.0.1:5000"


async def test_registration_gives_up_after_the_attempts_or_on_stop() -> None:
    reg = FlakyRegistry(failures=100)
    ok = await register_until_done(
        cast(Registry, reg), _me(), CheckSpec(), None, asyncio.Event(), attempts=2, backoff_min_s=0.001
    )
    assert not ok and reg.calls == 2 and not reg.registered
    stopping = asyncio.Event()
    stopping.set()
    ok = await register_until_done(cast(Registry, reg), _me(), CheckSpec(), None, stopping, backoff_min_s=0.001)
    assert not ok and reg.calls == 3  # one try, then the stop ends the retries
