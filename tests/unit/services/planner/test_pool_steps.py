"""The planning loop of a disaggregated zone (`--pools`): each worker's role read from the router's listing, the
pool sizing and role changes in GetPlan, dry-run only counting them, and a role-changing actuator draining the
worker through the router, then stopping it and starting one of the other role in its place.

The router is a stand-in (`_Router`: ListWorkers and DrainWorker answered from a list, as the real router's
admin service answers them) so that a step's every input is fixed; the real router's listing of roles is the
router's own tests'."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvmesh.core.handoff import WorkerRole
from kvmesh.discovery.model import WORKER_ROLE_META
from kvmesh.ops.planner.pools import PoolPolicy
from kvmesh.ops.planner.sizing import SizingPolicy
from kvmesh.ops.planner.zone import PlannerConfig, ZonePlanner
from kvmesh.services.planner import metrics as m
from kvmesh.services.planner.__main__ import planner_config
from kvmesh.services.planner.actuators import DryRun
from kvmesh.services.planner.loop import PlannerLoop, roles_of
from kvmesh.services.planner.servicer import PlannerServicer
from kvmesh.services.planner.settings import PlannerSettings
from kvmesh.suite.admin import render, views
from kvmesh.v1 import common_pb2, planner_pb2, router_pb2, worker_pb2

ZONE = "a"
ROLES = ("prefill", "decode", "decode", "decode")


class _Router:
    """A router's admin service as the loop calls it: its workers (ids w0.., addresses 10.0.0.i:1, roles from
    ROLES in their endpoint meta), every request counter at `served`, and the drains asked of it."""

    def __init__(self) -> None:
        self.served = 0
        self.drained: list[str] = []
        self.busy: set[str] = set()  # workers with a request in flight

    async def ListWorkers(self, _req: router_pb2.ListWorkersRequest, timeout: float) -> router_pb2.ListWorkersResponse:
        reply = router_pb2.ListWorkersResponse()
        for i, role in enumerate(ROLES):
            wid = f"w{i}"
            w = reply.workers.add(selections_total=self.served, draining=wid in self.drained)
            w.in_flight = int(wid in self.busy)
            w.endpoint.CopyFrom(
                common_pb2.Endpoint(
                    id=f"w{i}", address=f"10.0.0.{i}:1", zone=ZONE, health=common_pb2.HEALTH_STATE_PASSING
                )
            )
            w.endpoint.meta[WORKER_ROLE_META] = role
        return reply

    async def DrainWorker(self, req: router_pb2.DrainWorkerRequest, timeout: float) -> router_pb2.DrainWorkerResponse:
        self.drained.append(req.worker_id)
        return router_pb2.DrainWorkerResponse()


class _RoleChangingActuator:
    """An actuator that records what it is asked (as the local one would start and stop processes)."""

    name = "recording"
    carries_out = True
    changes_roles = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    async def start(self, zone: str, role: WorkerRole | None = None) -> str:
        self.calls.append(("start", zone, str(role)))
        return "w-new"

    async def stop(self, zone: str, address: str, worker_id: str) -> None:
        self.calls.append(("stop", zone, address, worker_id))

    def removable(self, zone: str) -> set[str] | None:
        return None

    async def close(self) -> None:
        return None


def _loop(actuator: Any) -> tuple[PlannerLoop, _Router]:
    # 2 req/s: 2000 prompt tokens/s · 1.2 / 1000 per prefill worker → 3 prefill; 2 streams → 1 decode
    sizing = SizingPolicy(per_worker_rps=1.0, min_workers=2, max_workers=20, scale_in_delay_s=1e9)
    pools = PoolPolicy(
        prompt_tokens_per_request=1000, output_tokens_per_request=10, prefill_tokens_per_s=1000, split_delay_s=0
    )
    config = PlannerConfig(sizing, bucket_s=10.0, average_window_s=30.0, pools=pools)
    loop = PlannerLoop({ZONE: ZonePlanner.create(config)}, {ZONE: "127.0.0.1:1"}, actuator, PlannerSettings())
    router = _Router()
    loop.zones[ZONE].stub = router  # type: ignore[assignment]
    return loop, router


async def _steps(loop: PlannerLoop, router: _Router, n: int) -> None:
    rt = loop.zones[ZONE]
    for t in range(n):
        router.served += 5  # each of the 4 workers: 20 requests a 10 s bucket in all
        await loop._zone_step(ZONE, rt, 10.0 * t)


def test_roles_come_from_the_endpoint_meta_and_unknown_ones_count_as_both() -> None:
    reply = router_pb2.ListWorkersResponse()
    for i, role in enumerate(("prefill", "decode", "sideways", "")):
        w = reply.workers.add()
        w.endpoint.address = f"h:{i}"
        if role:
            w.endpoint.meta[WORKER_ROLE_META] = role
    assert roles_of(reply.workers) == {"h:0": WorkerRole.PREFILL, "h:1": WorkerRole.DECODE}


async def test_dry_run_shows_the_pools_and_the_role_change_and_drains_nothing() -> None:
    loop, router = _loop(DryRun())
    counted = m.ACTIONS.labels(ZONE, "role_change_dry_run")._value.get()
    await _steps(loop, router, 11)
    assert router.drained == []
    assert m.ACTIONS.labels(ZONE, "role_change_dry_run")._value.get() > counted
    assert m.POOL_DESIRED.labels(ZONE, "prefill")._value.get() == 3
    assert m.POOL_SERVING.labels(ZONE, "decode")._value.get() == 3
    reply = await PlannerServicer(loop, "dry-run", 60).GetPlan(planner_pb2.GetPlanRequest(), None)  # type: ignore[arg-type]
    split = reply.zones[0].last.pools
    assert (split.desired_prefill, split.desired_decode, split.prefill, split.decode) == (3, 1, 1, 3)
    assert [(c.worker_id, c.address, c.from_role, c.to_role) for c in split.role_changes] == [
        ("w1", "10.0.0.1:1", worker_pb2.WORKER_ROLE_DECODE, worker_pb2.WORKER_ROLE_PREFILL)
    ]
    text = render.plan(views.plan(reply, "p:1"), now=200.0)
    assert "pools: prefill 1 serving / 3 desired" in text and "w1 decode -> prefill" in text, text


async def test_a_role_changing_actuator_drains_then_restarts_the_worker_in_the_other_role() -> None:
    actuator = _RoleChangingActuator()
    loop, router = _loop(actuator)
    router.busy = {"w1", "w2", "w3"}
    await _steps(loop, router, 12)
    # drained first, and stopped only once nothing is in flight on it; with no delay between changes, the next
    # step takes a second decode worker (the pools need 3P/1D), counting the one already changing as prefill;
    # neither is replaced by a scale-out meanwhile (a changing worker counts as starting)
    assert router.drained == ["w1", "w2"] and actuator.calls == []
    assert loop.zones[ZONE].incoming() == {WorkerRole.PREFILL: 2}
    router.busy = set()
    await _steps(loop, router, 1)
    assert actuator.calls[:2] == [("stop", ZONE, "10.0.0.1:1", "w1"), ("stop", ZONE, "10.0.0.2:1", "w2")]
    await asyncio.sleep(0)  # the starts run as tasks beside the loop, as real starts do
    assert actuator.calls[2:] == [("start", ZONE, "prefill")] * 2
    assert loop.zones[ZONE].incoming() == {WorkerRole.PREFILL: 2}  # until the router lists them passing


def test_pool_settings_reach_the_planner_and_bad_ones_name_their_setting() -> None:
    config = planner_config(PlannerSettings(pools=True, decode_worker_streams=8, itl_target_ms=40))
    assert config.pools is not None and (config.pools.decode_streams, config.pools.itl_s) == (8, 0.04)
    assert planner_config(PlannerSettings()).pools is None
    from kvmesh.core.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as err:
        planner_config(PlannerSettings(pools=True, min_decode_workers=0))
    assert err.value.field == "min_decode_workers"
