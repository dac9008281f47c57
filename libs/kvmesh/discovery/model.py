"""Discovery domain model: service instances, health, catalog snapshots (pure data, no I/O).

A kvmesh service instance carries its zone, version and role. In Consul they travel twice, as tags
(``zone=a``, ``version=v1``, ``role=router``, plus the bare tag ``kvmesh``) and as service meta
(``zone``, ``version``, ``role``, ``capacity``); meta wins when both are present.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvmesh.core.errors import InvalidArgument

KVMESH_TAG = "kvmesh"
REPLICATION_PENDING_META = "replication_pending"
"""A cache-manager's meta key: the followed zones (comma-separated) it has not finished replicating its hot
prefixes into; the failover service holds a restored zone's ramp while one lists it (`kvmesh.discovery.zones`)."""
SERVICE_PREFIX = "kvmesh-"
WORKER_ROLE_META = "worker_role"
"""A worker's meta key: its part in prefill/decode disaggregation (`kvmesh.core.handoff.WorkerRole`: both, prefill
or decode; absent reads as both). Not `role`, which is the service's role (`Role`: worker, router ...)."""


class Health(enum.StrEnum):
    """Aggregated health of an instance; ordered passing < warning < critical."""

    PASSING = "passing"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return _RANK[self]

    @staticmethod
    def worst(states: Iterable[Health]) -> Health:
        """Consul's aggregation: the worst status over all checks; no checks at all means passing."""
        out = Health.PASSING
        for s in states:
            if s.rank > out.rank:
                out = s
        return out


_RANK = {Health.PASSING: 0, Health.WARNING: 1, Health.CRITICAL: 2}


class Role(enum.StrEnum):
    ROUTER = "router"
    CACHE_MANAGER = "cache-manager"
    WORKER = "worker"
    FAILOVER = "failover"

    @property
    def service_name(self) -> str:
        """Consul service name of this role, e.g. ``kvmesh-router``."""
        return SERVICE_PREFIX + self.value


@dataclass(frozen=True)
class ServiceInstance:
    """One registered process. `capacity` is the relative serving capacity of a worker (default 1)."""

    id: str
    role: Role
    zone: str
    version: str
    address: str
    port: int
    health: Health = Health.PASSING
    capacity: float = 1.0
    meta: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id:
            raise InvalidArgument("id", "must not be empty")
        if not self.zone:
            raise InvalidArgument("zone", "must not be empty")
        if not (0 <= self.port < 65536):
            raise InvalidArgument("port", f"out of range: {self.port}")
        if not self.capacity >= 0:
            raise InvalidArgument("capacity", f"must be >= 0, got {self.capacity}")

    @property
    def service_name(self) -> str:
        return self.role.service_name

    @property
    def target(self) -> str:
        """``host:port`` for a gRPC channel."""
        return f"{self.address}:{self.port}"

    def tags(self) -> list[str]:
        return [KVMESH_TAG, f"zone={self.zone}", f"version={self.version}", f"role={self.role.value}"]

    def consul_meta(self) -> dict[str, str]:
        out = dict(self.meta)
        out.update(zone=self.zone, version=self.version, role=self.role.value, capacity=repr(self.capacity))
        return out


def parse_labels(tags: Iterable[str], meta: Mapping[str, str] | None) -> dict[str, str]:
    """zone/version/role/capacity from ``key=value`` tags, overridden by meta keys."""
    out: dict[str, str] = {}
    for t in tags:
        k, sep, v = t.partition("=")
        if sep and k in ("zone", "version", "role", "capacity"):
            out[k] = v
    for k in ("zone", "version", "role", "capacity"):
        if meta and meta.get(k):
            out[k] = meta[k]
    return out


@dataclass(frozen=True)
class CatalogSnapshot:
    """All kvmesh instances known to a registry at one index, sorted by id."""

    instances: tuple[ServiceInstance, ...] = ()

    @staticmethod
    def of(instances: Iterable[ServiceInstance]) -> CatalogSnapshot:
        return CatalogSnapshot(tuple(sorted(instances, key=lambda i: i.id)))

    def zones(self) -> list[str]:
        return sorted({i.zone for i in self.instances})

    def by_id(self) -> dict[str, ServiceInstance]:
        return {i.id: i for i in self.instances}

    def to_json(self) -> list[dict[str, object]]:
        return [
            {
                "id": i.id,
                "role": i.role.value,
                "zone": i.zone,
                "version": i.version,
                "address": i.address,
                "port": i.port,
                "health": i.health.value,
                "capacity": i.capacity,
                "meta": dict(i.meta),
            }
            for i in self.instances
        ]

    @staticmethod
    def from_json(items: Iterable[Mapping[str, object]]) -> CatalogSnapshot:
        return CatalogSnapshot.of(instance_from_mapping(m) for m in items)


def instance_from_mapping(m: Mapping[str, object]) -> ServiceInstance:
    """Build an instance from a plain mapping (YAML/JSON); raises InvalidArgument on bad fields."""
    try:
        role = Role(str(m["role"]))
    except (KeyError, ValueError) as e:
        raise InvalidArgument("role", f"unknown or missing role in {dict(m)!r}") from e
    try:
        health = Health(str(m.get("health", "passing")))
    except ValueError as e:
        raise InvalidArgument("health", f"unknown health {m.get('health')!r}") from e
    meta_raw = m.get("meta") or {}
    meta = {str(k): str(v) for k, v in meta_raw.items()} if isinstance(meta_raw, Mapping) else {}
    try:
        port = int(str(m["port"]))
        capacity = float(str(m.get("capacity", 1.0)))
    except (KeyError, ValueError) as e:
        raise InvalidArgument("port", f"bad port/capacity in {dict(m)!r}") from e
    return ServiceInstance(
        id=str(m["id"]),
        role=role,
        zone=str(m.get("zone", "")),
        version=str(m.get("version", "")),
        address=str(m.get("address", "127.0.0.1")),
        port=port,
        health=health,
        capacity=capacity,
        meta=meta,
    )
