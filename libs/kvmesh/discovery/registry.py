"""The registry protocol shared by the static (YAML) and Consul registries."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from kvmesh.discovery.model import CatalogSnapshot, Health, ServiceInstance

HealthProbe = Callable[[], Awaitable[Health]]
"""What a service reports about itself when its registry check is a TTL it refreshes."""


@dataclass(frozen=True)
class CheckSpec:
    """How the registry checks an instance.

    ``mode="grpc"``: the agent calls ``grpc.health.v1.Health/Check`` on the instance address every
    `interval_s` (TLS when `use_tls`), falling back to a TTL check if the agent refuses it.
    ``mode="ttl"``: the instance reports itself every ``ttl_s / 3`` seconds; missing ``ttl_s``
    seconds of reports makes it critical. `deregister_after_s` removes an instance critical for longer.
    """

    mode: str = "grpc"
    interval_s: float = 1.0
    timeout_s: float = 1.0
    ttl_s: float = 3.0
    use_tls: bool = False
    grpc_service: str = ""
    deregister_after_s: float = 0.0


class Registry(Protocol):
    """Service registration and discovery with blocking-query semantics.

    `watch(index, wait_s)` returns ``(new_index, snapshot)`` as soon as the registry's state index
    exceeds `index`, or after about `wait_s` seconds with an unchanged index (a return is no
    guarantee of a change). Index 0 returns at once. Failures to reach the backend raise
    `kvmesh.core.errors.Unavailable`.
    """

    async def register(self, instance: ServiceInstance, check: CheckSpec, probe: HealthProbe | None = None) -> None: ...

    async def deregister(self, instance_id: str) -> None: ...

    async def snapshot(self) -> tuple[int, CatalogSnapshot]: ...

    async def watch(self, index: int, wait_s: float) -> tuple[int, CatalogSnapshot]: ...

    async def close(self) -> None: ...
