"""A partition of one zone's link (network namespaces + veth made by the test) is detected and healed.

Two zones, each in its own namespace with real failover, router, cache-manager and worker processes;
the Consul STAND-IN in the root namespace runs gRPC health checks across the veths. The link of
zone a is cut: the failover service of zone b must report zone a unhealthy (weight 0) within 3 s;
when the link is back, zone a returns through hysteresis and a gradual weight ramp.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import grpc.aio
import pytest

from kvmesh.bench import netns
from kvmesh.client.endpoints import EndpointSet
from kvmesh.client.watch import EndpointWatcher
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, failover_pb2, failover_pb2_grpc
from tests.consul_standin.launch import start_standin
from tests.support.procs import start_together

pytestmark = [pytest.mark.fault, pytest.mark.slow]
CHECK_INTERVAL_S = 0.3
RAMP_S = 3.0


@pytest.fixture
def zones() -> Iterator[tuple[netns.Zone, netns.Zone]]:
    reason = netns.available()
    if reason:
        pytest.skip(reason)
    a = netns.create_zone("a", 0)
    try:
        b = netns.create_zone("b", 1)
    except BaseException:
        a.destroy()
        raise
    yield a, b
    a.destroy()
    b.destroy()


@pytest.fixture
def procs() -> Iterator[list[ServiceProcess]]:
    started: list[ServiceProcess] = []
    yield started
    for sp in reversed(started):
        try:
            sp.terminate(timeout=10)
        except Exception:  # teardown must reach every process
            sp.kill()


async def wait_set(w: EndpointWatcher, pred: Callable[[EndpointSet], bool], timeout_s: float) -> EndpointSet:
    deadline = time.monotonic() + timeout_s
    seen = w.updates
    history = [w.current.zone_weights]
    while not pred(w.current):
        left = deadline - time.monotonic()
        assert left > 0, f"not reached within {timeout_s}s; zone weights seen: {history}"
        seen = await w.wait_update(seen, left)
        history.append(w.current.zone_weights)
    return w.current


def healthy_zone_ids(eps: EndpointSet, zone: str) -> set[str]:
    return {i.id for i in eps.instances if i.zone == zone}


async def test_zone_link_partition_detected_and_healed(
    zones: tuple[netns.Zone, netns.Zone], procs: list[ServiceProcess], tmp_path: Path
) -> None:
    a, b = zones
    consul = start_standin(hosts=("127.0.0.1", a.host_ip, b.host_ip))
    try:

        def start(z: netns.Zone, name: str, *args: str) -> ServiceProcess:
            sp = netns.start_in_zone(z, name, tmp_path / "svc", *args)
            procs.append(sp)
            return sp

        def start_failover(z: netns.Zone) -> ServiceProcess:
            return start(
                z,
                "failover",
                "--consul-url",
                f"http://{z.host_ip}:{consul.port}",
                "--advertise-host",
                z.ns_ip,
                "--zones",
                "a,b",
                "--health-interval-s",
                "0.2",
                "--watch-wait-s",
                "2",
                "--registry-timeout-s",
                "1",
                "--up-observations",
                "2",
                "--up-hold-s",
                "1",
                "--min-dwell-s",
                "2",
                "--ramp-s",
                str(RAMP_S),
                "--lkg-file",
                str(tmp_path / f"lkg-{z.name}.json"),
            )

        # every process of both zones at once: none needs another's address to start (they meet through the
        # registrations below)
        fo_a, fo_b, *_ = start_together(
            partial(start_failover, a),
            partial(start_failover, b),
            *(partial(start, z, name) for z in (a, b) for name in ("cache-manager", "worker", "router")),
        )
        failovers = {"a": fo_a, "b": fo_b}
        async with grpc.aio.insecure_channel(failovers["b"].address) as ch:
            stub = failover_pb2_grpc.FailoverServiceStub(ch)
            roles = {
                "router": common_pb2.SERVICE_ROLE_ROUTER,
                "worker": common_pb2.SERVICE_ROLE_WORKER,
                "cache-manager": common_pb2.SERVICE_ROLE_CACHE_MANAGER,
            }
            for sp in procs:
                if sp.name in roles:
                    await stub.Register(
                        failover_pb2.RegisterRequest(
                            endpoint=common_pb2.Endpoint(
                                id=sp.info["id"],
                                role=roles[sp.name],
                                address=sp.address,
                                zone=sp.info["zone"],
                                version="v1",
                            ),
                            check_interval_s=CHECK_INTERVAL_S,
                        ),
                        timeout=5,
                    )

        watcher = EndpointWatcher([failovers["b"].address])
        await watcher.start()
        try:
            both = await wait_set(
                watcher,
                lambda e: (
                    e.zone_healthy == {"a": True, "b": True}
                    and e.zone_weights == {"a": 0.5, "b": 0.5}
                    and len(healthy_zone_ids(e, "a")) >= 4
                ),
                30,
            )
            assert {i.role.value for i in both.instances if i.zone == "a"} >= {"router", "worker", "cache-manager"}

            t0 = time.monotonic()
            a.partition()
            cut = await wait_set(watcher, lambda e: not e.zone_healthy["a"] and e.zone_weights["a"] == 0.0, 10)
            detected_s = time.monotonic() - t0
            assert detected_s <= 3.0, f"partition detected after {detected_s:.2f}s"
            assert cut.zone_weights["b"] == pytest.approx(1.0)
            assert all(w == 0 or cut.by_id()[rid].zone == "b" for rid, w in cut.router_weights.items())
            # every instance of zone a goes critical and leaves the published sets
            await wait_set(watcher, lambda e: not healthy_zone_ids(e, "a"), 10)
            assert time.monotonic() - t0 <= 3.0 + CHECK_INTERVAL_S

            t1 = time.monotonic()
            a.heal()
            ramping = await wait_set(watcher, lambda e: 0.0 < e.zone_weights.get("a", 0.0) < 0.45, 15)
            assert ramping.zone_weights["b"] > 0.55  # zone a comes back gradually, not at once
            back = await wait_set(watcher, lambda e: abs(e.zone_weights.get("a", 0.0) - 0.5) < 1e-6, 15)
            assert back.zone_healthy == {"a": True, "b": True}
            assert time.monotonic() - t1 >= RAMP_S * 0.9
        finally:
            await watcher.stop()

        # the failover service inside zone a lost Consul during the cut; once healed it is fresh again
        wa = EndpointWatcher([failovers["a"].address])
        await wa.start()
        try:
            await wait_set(wa, lambda e: not e.stale and abs(e.zone_weights.get("b", 0.0) - 0.5) < 0.2, 20)
        finally:
            await wa.stop()
    finally:
        consul.stop()
