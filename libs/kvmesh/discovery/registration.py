"""Choosing a registry from settings, and a service registering itself (used by every service's wiring).

`registry_from(registry_file, consul_url)`: Consul when `consul_url` is set (``http://host:port``),
else the static YAML registry at `registry_file`, else None (no discovery). `parse_weights` reads the
``"a=1,b=2"`` syntax of weight flags (validated by `traffic.normalise_weights`). `register_until_done`
registers with bounded retries: the registry may be down while the service starts, and it serves anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from collections.abc import Mapping

from kvmesh.core.errors import InvalidArgument, KvmeshError
from kvmesh.discovery.consul import ConsulRegistry
from kvmesh.discovery.model import Role, ServiceInstance
from kvmesh.discovery.registry import CheckSpec, HealthProbe, Registry
from kvmesh.discovery.static import StaticRegistry
from kvmesh.discovery.traffic import normalise_weights

log = logging.getLogger(__name__)
REGISTER_ATTEMPTS = 30


def registry_from(registry_file: str, consul_url: str, request_timeout_s: float = 5.0) -> Registry | None:
    if consul_url:
        u = urllib.parse.urlparse(consul_url if "//" in consul_url else f"http://{consul_url}")
        if not u.hostname:
            raise InvalidArgument("consul_url", f"cannot parse {consul_url!r}")
        return ConsulRegistry(
            u.hostname, u.port or 8500, scheme=u.scheme or "http", request_timeout_s=request_timeout_s
        )
    if registry_file:
        return StaticRegistry(registry_file)
    return None


def parse_weights(field: str, text: str) -> dict[str, float]:
    """``"a=1,b=2"`` → normalised ``{"a": 1/3, "b": 2/3}``; raises InvalidArgument on bad syntax/values."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, val = part.partition("=")
        if not sep:
            raise InvalidArgument(field, f"expected key=weight, got {part!r}")
        try:
            out[key.strip()] = float(val)
        except ValueError as e:
            raise InvalidArgument(f"{field}[{key.strip()}]", f"not a number: {val!r}") from e
    return normalise_weights(field, out)


def self_instance(
    *,
    instance_id: str,
    role: Role,
    zone: str,
    version: str,
    address: str,
    capacity: float = 1.0,
    meta: Mapping[str, str] | None = None,
) -> ServiceInstance:
    """This process as a registry instance (``address`` = ``host:port`` of its gRPC server)."""
    host, _, port = address.rpartition(":")
    return ServiceInstance(instance_id, role, zone, version, host, int(port), capacity=capacity, meta=dict(meta or {}))


async def register_until_done(
    registry: Registry,
    instance: ServiceInstance,
    check: CheckSpec,
    probe: HealthProbe | None,
    stopping: asyncio.Event,
    attempts: int = REGISTER_ATTEMPTS,
    backoff_min_s: float = 0.2,
    backoff_max_s: float = 5.0,
) -> bool:
    """Registers `instance`, retrying failures after ``min(backoff_max_s, backoff_min_s * 2**k)`` until it
    succeeds (True), `stopping` is set or `attempts` failed (False)."""
    for attempt in range(attempts):
        try:
            await registry.register(instance, check, probe)
            return True
        except (KvmeshError, OSError) as exc:
            log.warning("registration of %s, attempt %d failed: %s", instance.id, attempt + 1, exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), min(backoff_max_s, backoff_min_s * 2**attempt))
        if stopping.is_set():
            return False
    log.error("%s could not register after %d attempts", instance.id, attempts)
    return False
