"""ConsulRegistry against the Consul STAND-IN process (real HTTP, real gRPC health checks)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator

import consul.aio
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.core.errors import NotFound, Unavailable
from kvmesh.discovery.consul import ConsulRegistry
from kvmesh.discovery.model import CatalogSnapshot, Health, Role, ServiceInstance
from kvmesh.discovery.policy import FailoverPolicy
from kvmesh.discovery.registry import CheckSpec
from kvmesh.discovery.zones import ZonePolicy
from tests.consul_standin.launch import StandinProcess, start_standin

pytestmark = pytest.mark.integration
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def standin() -> Iterator[StandinProcess]:
    sp = start_standin(reap_interval_s=1.0)
    yield sp
    sp.stop()


@pytest.fixture
async def registry(standin: StandinProcess) -> AsyncIterator[ConsulRegistry]:
    reg = ConsulRegistry(port=standin.port, request_timeout_s=3.0)
    yield reg
    await reg.close(deregister=False)


class HealthServer:
    def __init__(self) -> None:
        self.server = grpc.aio.server()
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    async def set(self, status: int) -> None:
        await self.servicer.set("", status)


@pytest.fixture
async def hserver() -> AsyncIterator[HealthServer]:
    hs = HealthServer()
    await hs.server.start()
    await hs.set(SERVING)
    yield hs
    await hs.server.stop(0)


def inst(iid: str, role: Role, port: int, zone: str = "a", version: str = "v1") -> ServiceInstance:
    return ServiceInstance(iid, role, zone, version, "127.0.0.1", port)


async def wait_for(
    reg: ConsulRegistry, pred: Callable[[CatalogSnapshot], bool], timeout_s: float = 10.0, index: int = 0
) -> tuple[int, CatalogSnapshot]:
    """Follow the registry with blocking watches until `pred` holds (bounded by `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    snap = CatalogSnapshot()
    while (left := deadline - time.monotonic()) > 0:
        index, snap = await reg.watch(index, min(left, 2.0))
        if pred(snap):
            return index, snap
    raise AssertionError(f"condition not reached within {timeout_s}s; last snapshot {snap}")


def health_of(snap: CatalogSnapshot, iid: str) -> Health | None:
    i = snap.by_id().get(iid)
    return i.health if i else None


async def test_grpc_check_passing_then_critical_within_one_interval(
    registry: ConsulRegistry, hserver: HealthServer
) -> None:
    interval = 0.3
    w = inst("w-a-1", Role.WORKER, hserver.port)
    await registry.register(w, CheckSpec(mode="grpc", interval_s=interval, timeout_s=0.5))
    assert registry.check_modes["w-a-1"] == "grpc"
    idx, snap = await wait_for(registry, lambda s: health_of(s, "w-a-1") is Health.PASSING)
    got = snap.by_id()["w-a-1"]
    assert (got.zone, got.version, got.role, got.port) == ("a", "v1", Role.WORKER, hserver.port)

    t0 = time.monotonic()
    await hserver.set(NOT_SERVING)
    _, snap = await wait_for(registry, lambda s: health_of(s, "w-a-1") is Health.CRITICAL, index=idx)
    elapsed = time.monotonic() - t0
    assert elapsed <= interval + 0.5, f"critical seen after {elapsed:.2f}s, interval {interval}s"
    # ... and the policy takes it out of the zone's rotation at once
    views = FailoverPolicy.create(ZonePolicy(), {"a": 1}, {"v1": 1}).observe(snap, 0.0).views
    assert [x.id for x in views["a"].workers] == []


async def test_killed_server_goes_critical(registry: ConsulRegistry, hserver: HealthServer) -> None:
    await registry.register(inst("r-a-1", Role.ROUTER, hserver.port), CheckSpec(interval_s=0.2, timeout_s=0.3))
    idx, _ = await wait_for(registry, lambda s: health_of(s, "r-a-1") is Health.PASSING)
    await hserver.server.stop(0)
    _, snap = await wait_for(registry, lambda s: health_of(s, "r-a-1") is Health.CRITICAL, index=idx)
    assert snap.by_id()["r-a-1"].health is Health.CRITICAL


async def test_ttl_check_refreshed_from_probe_and_expires(registry: ConsulRegistry) -> None:
    state = {"h": Health.PASSING}

    async def probe() -> Health:
        return state["h"]

    spec = CheckSpec(mode="ttl", ttl_s=0.9)
    await registry.register(inst("cm-a-1", Role.CACHE_MANAGER, 1), spec, probe)
    assert registry.check_modes["cm-a-1"] == "ttl"
    idx, _ = await wait_for(registry, lambda s: health_of(s, "cm-a-1") is Health.PASSING)
    state["h"] = Health.WARNING
    idx, _ = await wait_for(registry, lambda s: health_of(s, "cm-a-1") is Health.WARNING, 3.0, idx)
    state["h"] = Health.PASSING
    idx, _ = await wait_for(registry, lambda s: health_of(s, "cm-a-1") is Health.PASSING, 3.0, idx)
    # the service stops refreshing (hung / killed): the agent expires the TTL
    registry._ttl_tasks.pop("cm-a-1").cancel()
    t0 = time.monotonic()
    await wait_for(registry, lambda s: health_of(s, "cm-a-1") is Health.CRITICAL, 5.0, idx)
    assert time.monotonic() - t0 <= spec.ttl_s + 0.5


async def test_blocking_watch_waits_then_returns_early_on_change(registry: ConsulRegistry) -> None:
    await registry.register(inst("r-a-1", Role.ROUTER, 1), CheckSpec(mode="ttl", ttl_s=30))
    idx, snap = await wait_for(registry, lambda s: health_of(s, "r-a-1") is Health.PASSING)
    t0 = time.monotonic()
    idx2, snap2 = await registry.watch(idx, 1.0)  # nothing changes: blocks ~wait, same index
    assert time.monotonic() - t0 >= 0.95
    assert idx2 == idx and snap2 == snap

    watch = asyncio.create_task(registry.watch(idx, 20.0))
    t0 = time.monotonic()
    await registry.register(inst("w-b-1", Role.WORKER, 2, zone="b"), CheckSpec(mode="ttl", ttl_s=30))
    idx3, snap3 = await asyncio.wait_for(watch, 10.0)
    assert time.monotonic() - t0 < 5.0
    assert idx3 > idx and "w-b-1" in snap3.by_id()


async def test_index_monotonic_deregister_and_unknown(registry: ConsulRegistry) -> None:
    seen = [(await registry.snapshot())[0]]
    for k in range(3):
        await registry.register(inst(f"w-{k}", Role.WORKER, 10 + k), CheckSpec(mode="ttl", ttl_s=30))
        seen.append((await registry.snapshot())[0])
    await registry.deregister("w-1")
    idx, snap = await registry.snapshot()
    seen.append(idx)
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert sorted(snap.by_id()) == ["w-0", "w-2"]
    with pytest.raises(NotFound):
        await registry.deregister("w-1")


async def test_close_deregisters_on_shutdown(standin: StandinProcess) -> None:
    reg = ConsulRegistry(port=standin.port)
    await reg.register(inst("f-a-1", Role.FAILOVER, 1), CheckSpec(mode="ttl", ttl_s=30))
    await reg.close()
    other = ConsulRegistry(port=standin.port)
    try:
        assert "f-a-1" not in (await other.snapshot())[1].by_id()
    finally:
        await other.close()


async def test_passing_filter_and_tags_with_py_consul(registry: ConsulRegistry, standin: StandinProcess) -> None:
    await registry.register(inst("r-ok", Role.ROUTER, 1), CheckSpec(mode="ttl", ttl_s=30))
    await registry.register(inst("r-bad", Role.ROUTER, 2), CheckSpec(mode="ttl", ttl_s=30), probe=None)
    await registry._report("r-bad", Health.CRITICAL)
    c = consul.aio.Consul(port=standin.port)
    try:
        _, everything = await c.health.service("kvmesh-router")
        _, passing = await c.health.service("kvmesh-router", passing=True)
        _, tagged = await c.catalog.service("kvmesh-router", tag="zone=a")
        _, services = await c.catalog.services()
    finally:
        await c.http.close()
    assert sorted(e["Service"]["ID"] for e in everything) == ["r-bad", "r-ok"]
    assert [e["Service"]["ID"] for e in passing] == ["r-ok"]
    assert sorted(e["ServiceID"] for e in tagged) == ["r-bad", "r-ok"]
    assert "zone=a" in services["kvmesh-router"] and "kvmesh" in services["kvmesh-router"]


async def test_unreachable_agent_is_unavailable(standin: StandinProcess) -> None:
    reg = ConsulRegistry(port=standin.port, request_timeout_s=1.0)
    try:
        await reg.snapshot()
        standin.kill()
        with pytest.raises(Unavailable):
            await reg.snapshot()
        with pytest.raises(Unavailable):
            await reg.watch(5, 0.5)
    finally:
        await reg.close(deregister=False)
