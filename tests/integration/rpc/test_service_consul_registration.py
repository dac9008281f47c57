"""Every service registers itself in Consul (the stand-in agent, a real process) and deregisters on SIGTERM.

The stand-in runs the native gRPC health check against the registered address, as a real agent does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from kvmesh.discovery.consul import ConsulRegistry
from kvmesh.discovery.model import Health, Role
from tests.consul_standin.launch import StandinProcess, start_standin
from tests.support.procs import ServiceProcess

pytestmark = pytest.mark.integration


@pytest.fixture
def standin() -> Iterator[StandinProcess]:
    sp = start_standin(reap_interval_s=1.0)
    yield sp
    sp.stop()


async def _wait_for(
    registry: ConsulRegistry, predicate: Callable[[dict[str, object]], bool], timeout: float = 20.0
) -> dict[str, object]:
    """Follows the catalog with blocking queries until `predicate(instances by id)` holds (bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout
    index, snap = await registry.snapshot()
    while not predicate(snap.by_id()):  # type: ignore[arg-type]
        left = deadline - asyncio.get_running_loop().time()
        assert left > 0, f"condition not reached; catalog: {snap.by_id()}"
        index, snap = await registry.watch(index, wait_s=min(left, 2.0))
    return snap.by_id()  # type: ignore[return-value]


@pytest.mark.parametrize("name", ["router", "cache-manager", "failover"])
async def test_service_registers_with_zone_version_role_and_deregisters(
    services: Callable[..., ServiceProcess], standin: StandinProcess, name: str
) -> None:
    sp = services(
        name,
        "--consul-url",
        f"http://127.0.0.1:{standin.port}",
        "--zone",
        "zone-a",
        "--version",
        "v7",
        "--service-id",
        f"{name}-a-0",
    )
    registry = ConsulRegistry(port=standin.port, request_timeout_s=3.0)
    try:
        by_id = await _wait_for(registry, lambda d: getattr(d.get(f"{name}-a-0"), "health", None) == Health.PASSING)
        inst = by_id[f"{name}-a-0"]
        assert (inst.role, inst.zone, inst.version) == (Role(name), "zone-a", "v7")  # type: ignore[attr-defined]
        assert inst.target == sp.address  # type: ignore[attr-defined]
        assert sp.terminate(timeout=30) == 0
        await _wait_for(registry, lambda d: f"{name}-a-0" not in d)
    finally:
        await registry.close(deregister=False)
