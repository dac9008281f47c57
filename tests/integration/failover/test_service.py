"""The failover service as a real process, over the Consul STAND-IN, with real gRPC health checks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvmesh.discovery.consul import ConsulRegistry
from kvmesh.discovery.model import REPLICATION_PENDING_META, Role, ServiceInstance
from kvmesh.discovery.registry import CheckSpec
from kvmesh.v1 import common_pb2, failover_pb2, failover_pb2_grpc
from tests.consul_standin.launch import StandinProcess, start_standin
from tests.support.procs import ServiceProcess
from tests.support.scrape import metric

pytestmark = pytest.mark.integration
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CHECK_INTERVAL_S = 0.3


class Fleet:
    """Health servers standing for each zone's router, cache-manager and two workers."""

    def __init__(self) -> None:
        self.servers: dict[str, tuple[grpc.aio.Server, Any, int]] = {}

    async def add(self, iid: str) -> int:
        server = grpc.aio.server()
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        await hs.set("", SERVING)
        self.servers[iid] = (server, hs, port)
        return port

    async def set(self, iid: str, status: int) -> None:
        await self.servers[iid][1].set("", status)

    async def close(self) -> None:
        for server, _, _ in self.servers.values():
            await server.stop(0)


ROLES = (("router", Role.ROUTER), ("cm", Role.CACHE_MANAGER), ("w0", Role.WORKER), ("w1", Role.WORKER))


@pytest.fixture
def standin() -> Iterator[StandinProcess]:
    sp = start_standin()
    yield sp
    sp.stop()


@pytest.fixture
async def fleet(standin: StandinProcess) -> AsyncIterator[Fleet]:
    f = Fleet()
    reg = ConsulRegistry(port=standin.port)
    for zone in ("a", "b"):
        for name, role in ROLES:
            iid = f"{zone}-{name}"
            port = await f.add(iid)
            await reg.register(
                ServiceInstance(iid, role, zone, "v1", "127.0.0.1", port),
                CheckSpec(interval_s=CHECK_INTERVAL_S, timeout_s=0.5),
            )
    yield f
    await reg.close(deregister=False)
    await f.close()


def failover_args(standin: StandinProcess, lkg: Path) -> list[str]:
    return [
        "--consul-url",
        f"http://127.0.0.1:{standin.port}",
        "--zones",
        "a,b",
        "--zone",
        "a",
        "--lkg-file",
        str(lkg),
        "--health-interval-s",
        "0.2",
        "--watch-wait-s",
        "2",
        "--registry-timeout-s",
        "1",
        "--min-dwell-s",
        "0",
        "--up-hold-s",
        "0",
        "--ramp-s",
        "0",
    ]


def zone(resp: failover_pb2.WatchEndpointsResponse, name: str) -> failover_pb2.ZoneEndpoints:
    return next(z for z in resp.zones if z.zone == name)


def ids(resp: failover_pb2.WatchEndpointsResponse, name: str) -> set[str]:
    return {e.id for e in zone(resp, name).endpoints if e.role != common_pb2.SERVICE_ROLE_FAILOVER}


async def next_matching(
    stream: Any, pred: Callable[[failover_pb2.WatchEndpointsResponse], bool], timeout_s: float = 15.0
) -> failover_pb2.WatchEndpointsResponse:
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while (left := deadline - time.monotonic()) > 0:
        try:
            last = await asyncio.wait_for(stream.read(), left)
        except TimeoutError:
            break
        if last is grpc.aio.EOF:
            raise AssertionError("stream ended")
        if pred(last):
            return last  # type: ignore[no-any-return]
    raise AssertionError(f"no matching endpoints within {timeout_s}s; last: {last}")


FULL = {"a-router", "a-cm", "a-w0", "a-w1"}
FULL_B = {"b-router", "b-cm", "b-w0", "b-w1"}


async def test_critical_worker_and_zone_failover_and_weights(
    services: Callable[..., ServiceProcess], standin: StandinProcess, fleet: Fleet, tmp_path: Path
) -> None:
    sp = services("failover", *failover_args(standin, tmp_path / "lkg.json"))
    async with grpc.aio.insecure_channel(sp.address) as ch:
        stub = failover_pb2_grpc.FailoverServiceStub(ch)
        stream = stub.WatchEndpoints(failover_pb2.WatchEndpointsRequest())
        await next_matching(stream, lambda r: ids(r, "a") == FULL and len(ids(r, "b")) == 4)

        t0 = time.monotonic()
        await fleet.set("a-w1", NOT_SERVING)
        r = await next_matching(stream, lambda r: "a-w1" not in ids(r, "a"))
        took = time.monotonic() - t0
        assert took <= CHECK_INTERVAL_S + 0.7, f"critical worker left rotation after {took:.2f}s"
        assert zone(r, "a").healthy  # 1 of 2 workers = 0.5, still at the threshold

        await fleet.set("a-router", NOT_SERVING)
        r = await next_matching(stream, lambda r: not zone(r, "a").healthy)
        assert zone(r, "a").weight == 0 and zone(r, "b").weight == pytest.approx(1.0)
        zh = await stub.GetZoneHealth(failover_pb2.GetZoneHealthRequest())
        a = next(z for z in zh.zones if z.zone == "a")
        assert not a.healthy and "no passing router" in a.reason and zh.registry_reachable

        await fleet.set("a-router", SERVING)
        await fleet.set("a-w1", SERVING)
        r = await next_matching(stream, lambda r: zone(r, "a").healthy and zone(r, "a").weight > 0.49)
        assert zone(r, "b").weight == pytest.approx(0.5, abs=0.01)

        # traffic weights: validation, version shares, rollback
        for bad in ({"a": -1.0, "b": 2.0}, {"a": 0.0, "b": 0.0}):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.SetTrafficWeights(
                    failover_pb2.SetTrafficWeightsRequest(weights=failover_pb2.TrafficWeights(zone_weights=bad))
                )
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        before = await stub.GetTrafficWeights(failover_pb2.GetTrafficWeightsRequest())
        # weights name real zones and versions only: a typo would take the real ones out of traffic
        typos = (
            ({"zone_weights": {"a": 1, "c": 1}}, "weights.zone_weights[c]: unknown zone 'c'"),
            ({"version_weights": {"v2": 1}}, "weights.version_weights[v2]: unknown version 'v2'"),
        )
        for typo, field in typos:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.SetTrafficWeights(
                    failover_pb2.SetTrafficWeightsRequest(weights=failover_pb2.TrafficWeights(**typo))
                )
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in (e.value.details() or "")
        assert await stub.GetTrafficWeights(failover_pb2.GetTrafficWeightsRequest()) == before
        got = await stub.SetTrafficWeights(
            failover_pb2.SetTrafficWeightsRequest(
                weights=failover_pb2.TrafficWeights(zone_weights={"a": 3, "b": 1}, version_weights={"v1": 95})
            )
        )
        assert dict(got.weights.zone_weights) == pytest.approx({"a": 0.75, "b": 0.25})
        assert dict(got.weights.version_weights) == pytest.approx({"v1": 1.0})
        r = await next_matching(stream, lambda r: abs(zone(r, "a").weight - 0.75) < 1e-6)
        back = await stub.RollbackTrafficWeights(failover_pb2.RollbackTrafficWeightsRequest())
        assert back.weights == before.weights
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.RollbackTrafficWeights(failover_pb2.RollbackTrafficWeightsRequest())
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        stream.cancel()


async def test_consul_down_serves_last_known_good_across_failover_restart(
    services: Callable[..., ServiceProcess], standin: StandinProcess, fleet: Fleet, tmp_path: Path
) -> None:
    args = failover_args(standin, tmp_path / "lkg.json")
    sp = services("failover", *args)
    async with grpc.aio.insecure_channel(sp.address) as ch:
        stub = failover_pb2_grpc.FailoverServiceStub(ch)
        stream = stub.WatchEndpoints(failover_pb2.WatchEndpointsRequest())
        await next_matching(stream, lambda r: ids(r, "a") == FULL and ids(r, "b") == FULL_B and not r.stale)
        standin.kill()
        r = await next_matching(stream, lambda r: r.stale)
        assert ids(r, "a") == FULL and zone(r, "a").healthy and zone(r, "b").weight == pytest.approx(0.5)
        stream.cancel()
    assert sp.terminate(timeout=20) == 0

    sp2 = services("failover", *args)  # restarted while Consul is still down
    async with grpc.aio.insecure_channel(sp2.address) as ch:
        stub = failover_pb2_grpc.FailoverServiceStub(ch)
        stream = stub.WatchEndpoints(failover_pb2.WatchEndpointsRequest())
        first = await next_matching(stream, lambda r: True, 5.0)
        assert first.stale and ids(first, "a") == FULL and ids(first, "b") == FULL_B
        zh = await stub.GetZoneHealth(failover_pb2.GetZoneHealthRequest())
        assert not zh.registry_reachable or first.stale
        stream.cancel()


async def test_version_weight_change_moves_that_share_of_client_traffic(
    services: Callable[..., ServiceProcess], standin: StandinProcess, fleet: Fleet, tmp_path: Path
) -> None:
    from kvmesh.client.watch import EndpointWatcher

    port = await fleet.add("a-router-v2")
    reg = ConsulRegistry(port=standin.port)
    await reg.register(
        ServiceInstance("a-router-v2", Role.ROUTER, "a", "v2", "127.0.0.1", port),
        CheckSpec(interval_s=CHECK_INTERVAL_S, timeout_s=0.5),
    )
    await reg.close(deregister=False)
    sp = services("failover", *failover_args(standin, tmp_path / "lkg.json"))
    watcher = EndpointWatcher([sp.address])
    await watcher.start()

    async def until(pred: Callable[[dict[str, float]], bool]) -> dict[str, float]:
        deadline = time.monotonic() + 15
        seen = watcher.updates
        while not pred(watcher.current.router_weights):
            assert time.monotonic() < deadline, watcher.current.router_weights
            seen = await watcher.wait_update(seen, deadline - time.monotonic())
        return watcher.current.router_weights

    def v2_share_is(target: float) -> Callable[[dict[str, float]], bool]:
        return lambda w: abs(w.get("a-router-v2", 0.0) - target) < 1e-6

    def share_v2(n: int = 1000) -> float:
        """Fraction of n evenly spread picks that land on the v2 router (what clients send it)."""
        picks = [watcher.current.pick((k + 0.5) / n) for k in range(n)]
        return sum(1 for p in picks if p is not None and p.version == "v2") / n

    try:
        await until(lambda w: {"a-router", "b-router"} <= set(w))
        assert share_v2() == 0.0  # v2 registered but on standby
        async with grpc.aio.insecure_channel(sp.address) as ch:
            stub = failover_pb2_grpc.FailoverServiceStub(ch)
            for pct in (5, 10, 50):
                await stub.SetTrafficWeights(
                    failover_pb2.SetTrafficWeightsRequest(
                        weights=failover_pb2.TrafficWeights(version_weights={"v1": 100 - pct, "v2": pct})
                    )
                )
                w = await until(v2_share_is(pct / 100))
                assert abs(share_v2() - pct / 100) <= 0.002
                assert sum(w.values()) == pytest.approx(1.0)
            await stub.RollbackTrafficWeights(failover_pb2.RollbackTrafficWeightsRequest())
            await until(v2_share_is(0.10))
            assert abs(share_v2() - 0.10) <= 0.002
    finally:
        await watcher.stop()


async def test_a_restored_zone_is_held_at_the_floor_until_the_other_zone_has_rewarmed_it(
    services: Callable[..., ServiceProcess], standin: StandinProcess, fleet: Fleet, tmp_path: Path
) -> None:
    """Zone a fails and comes back while zone b's cache-manager still lists it in its `replication_pending`
    meta: a is healthy but held at the ramp floor (5 %) and reported re-warming; once b's meta clears, a takes
    its full share, and the hold's end is timed as `warm`."""
    sp = services("failover", *failover_args(standin, tmp_path / "lkg.json"))
    reg = ConsulRegistry(port=standin.port)
    b_cm = ServiceInstance("b-cm", Role.CACHE_MANAGER, "b", "v1", "127.0.0.1", fleet.servers["b-cm"][2])
    check = CheckSpec(interval_s=CHECK_INTERVAL_S, timeout_s=0.5)
    try:
        async with grpc.aio.insecure_channel(sp.address) as ch:
            stub = failover_pb2_grpc.FailoverServiceStub(ch)
            stream = stub.WatchEndpoints(failover_pb2.WatchEndpointsRequest())
            both = lambda r: zone(r, "a").healthy and zone(r, "b").healthy  # noqa: E731
            await next_matching(stream, lambda r: ids(r, "a") == FULL and ids(r, "b") == FULL_B and both(r))
            holds = metric(sp.http_port, "kvmesh_failover_rewarm_hold_seconds_count", 'outcome="warm"')
            held_s = metric(sp.http_port, "kvmesh_failover_rewarm_hold_seconds_sum", 'outcome="warm"')
            await reg.register(replace(b_cm, meta={REPLICATION_PENDING_META: "a"}), check)
            await fleet.set("a-router", NOT_SERVING)
            await next_matching(stream, lambda r: not zone(r, "a").healthy)
            await fleet.set("a-router", SERVING)
            r = await next_matching(stream, lambda r: zone(r, "a").healthy)
            assert zone(r, "a").weight == pytest.approx(0.05 / 1.05, abs=1e-3)  # held at the floor
            a = next(z for z in (await stub.GetZoneHealth(failover_pb2.GetZoneHealthRequest())).zones if z.zone == "a")
            assert a.rewarm_hold and list(a.rewarm_pending_from) == ["b"]
            await reg.register(b_cm, check)  # b has nothing left to copy into a
            r = await next_matching(stream, lambda r: zone(r, "a").weight > 0.49)
            assert zone(r, "b").weight == pytest.approx(0.5, abs=0.01)
            a = next(z for z in (await stub.GetZoneHealth(failover_pb2.GetZoneHealthRequest())).zones if z.zone == "a")
            assert not a.rewarm_hold and not a.rewarm_pending_from
            assert metric(sp.http_port, "kvmesh_failover_rewarm_hold_seconds_count", 'outcome="warm"') == holds + 1
            assert metric(sp.http_port, "kvmesh_failover_rewarm_hold_seconds_sum", 'outcome="warm"') > held_s
            stream.cancel()
    finally:
        await reg.close(deregister=False)
