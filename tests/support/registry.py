"""Writing instances into a static registry file (what the failover service reads) in tests."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvmesh.discovery.model import Health, Role, ServiceInstance
from kvmesh.discovery.static import StaticRegistry


def inst(iid: str, role: Role, sp_address: str, zone: str = "a", health: Health = Health.PASSING) -> ServiceInstance:
    """An instance of `role` at a service process's address, version v1."""
    host, _, port = sp_address.rpartition(":")
    return ServiceInstance(iid, role, zone, "v1", host, int(port), health)


def register(path: Path, *instances: ServiceInstance) -> None:
    """Adds (or replaces) `instances` in the static registry file at `path`."""

    async def go() -> None:
        reg = StaticRegistry(path)
        for i in instances:
            await reg.register(i)

    asyncio.run(go())
