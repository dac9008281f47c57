"""ProbedRegistry: static-registry instances probed over grpc.health.v1 against real gRPC servers on 127.0.0.1.

A server that is stopped turns critical within ``failures`` probes; one answering NOT_SERVING too; a server
back on the same port turns passing again after ``successes`` probes. An address nobody listens on is critical.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from kvmesh.discovery.checks import ProbePolicy
from kvmesh.discovery.model import CatalogSnapshot, Health, Role, ServiceInstance
from kvmesh.discovery.probing import PROBE_CHANNEL_OPTIONS, ProbedRegistry
from kvmesh.discovery.static import StaticRegistry, write_catalog

pytestmark = pytest.mark.integration

POLICY = ProbePolicy(interval_s=0.1, timeout_s=0.3, failures=3, successes=2)
# failures * interval plus one interval of phase, with room for a loaded CI machine
DETECT_BOUND_S = 2.0


async def serve(port: int = 0) -> tuple[grpc.aio.Server, HealthServicer, int]:
    server = grpc.aio.server()
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await health.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, health, bound


def closed_port() -> int:
    with socket.socket() as s:  # bound, never listening: connections are refused
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_health(reg: ProbedRegistry, want: Callable[[dict[str, Health]], bool], timeout_s: float) -> float:
    """Waits on the registry's watch until `want(health by id)`; returns the seconds it took."""
    start = time.monotonic()
    index, snap = await reg.snapshot()
    while not want({i.id: i.health for i in snap.instances}):
        left = start + timeout_s - time.monotonic()
        if left <= 0:
            raise AssertionError(f"not reached within {timeout_s}s: {snap}")
        index, snap = await reg.watch(index, left)
    return time.monotonic() - start


@pytest.fixture
async def server() -> AsyncIterator[tuple[grpc.aio.Server, HealthServicer, int]]:
    srv = await serve()
    yield srv
    await srv[0].stop(None)


async def test_stopped_server_turns_critical_and_passing_when_back(
    tmp_path: Path, server: tuple[grpc.aio.Server, HealthServicer, int]
) -> None:
    srv, health, port = server
    path = tmp_path / "registry.yaml"
    write_catalog(
        path,
        CatalogSnapshot.of(
            [
                ServiceInstance("router", Role.ROUTER, "a", "v1", "127.0.0.1", port),
                ServiceInstance("ghost", Role.WORKER, "a", "v1", "127.0.0.1", closed_port()),
            ]
        ),
    )
    reg = ProbedRegistry(
        StaticRegistry(path, poll_s=0.02),
        POLICY,
        lambda target: grpc.aio.insecure_channel(target, options=PROBE_CHANNEL_OPTIONS),
    )
    await reg.start()
    try:
        await wait_health(reg, lambda h: h == {"router": Health.PASSING, "ghost": Health.CRITICAL}, 10.0)

        await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        took = await wait_health(reg, lambda h: h["router"] is Health.CRITICAL, 10.0)
        assert took <= DETECT_BOUND_S, f"NOT_SERVING seen after {took:.2f}s"
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        await wait_health(reg, lambda h: h["router"] is Health.PASSING, 10.0)

        await srv.stop(None)
        took = await wait_health(reg, lambda h: h["router"] is Health.CRITICAL, 10.0)
        assert took <= DETECT_BOUND_S, f"stopped server seen after {took:.2f}s"

        again, _, _ = await serve(port)
        try:
            took = await wait_health(reg, lambda h: h["router"] is Health.PASSING, 10.0)
            assert took <= DETECT_BOUND_S, f"restarted server passing after {took:.2f}s"
        finally:
            await again.stop(None)
    finally:
        await reg.close()


async def test_file_health_still_applies(tmp_path: Path, server: tuple[grpc.aio.Server, HealthServicer, int]) -> None:
    """An operator marking an instance critical in the file wins over passing probes."""
    _, _, port = server
    path = tmp_path / "registry.yaml"
    inner = StaticRegistry(path, poll_s=0.02)
    router = ServiceInstance("router", Role.ROUTER, "a", "v1", "127.0.0.1", port)
    await inner.register(router)
    reg = ProbedRegistry(inner, POLICY, lambda t: grpc.aio.insecure_channel(t, options=PROBE_CHANNEL_OPTIONS))
    await reg.start()
    try:
        await wait_health(reg, lambda h: h == {"router": Health.PASSING}, 10.0)
        await StaticRegistry(path).register(
            ServiceInstance("router", Role.ROUTER, "a", "v1", "127.0.0.1", port, Health.CRITICAL)
        )
        await wait_health(reg, lambda h: h == {"router": Health.CRITICAL}, 10.0)
        await reg.deregister("router")
        await wait_health(reg, lambda h: h == {}, 10.0)
    finally:
        await reg.close()
