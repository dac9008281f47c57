"""Endpoint sets as a client sees them, and the weighted router pick (pure: randomness passed in).

Router probabilities follow `kvmesh.discovery.policy.router_weights`:
``P(e) = s_v * (w_z / sum_{z' has v} w_z') / n(z, v)`` from the zone weights and version weights of a
``WatchEndpointsResponse``. `pick(u, exclude)` walks the cumulative distribution with ``u`` in
[0, 1) over the routers not in `exclude`, renormalised; if every weighted router is excluded it falls
back to any non-excluded router of any zone (equal weights), then to None.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.discovery.model import CatalogSnapshot, Health, Role, ServiceInstance
from kvmesh.discovery.policy import router_weights
from kvmesh.discovery.zones import ZonePolicy, build_zone_views
from kvmesh.v1 import common_pb2, failover_pb2

PB_ROLE = {
    common_pb2.SERVICE_ROLE_ROUTER: Role.ROUTER,
    common_pb2.SERVICE_ROLE_WORKER: Role.WORKER,
    common_pb2.SERVICE_ROLE_CACHE_MANAGER: Role.CACHE_MANAGER,
    common_pb2.SERVICE_ROLE_FAILOVER: Role.FAILOVER,
}
PB_HEALTH = {common_pb2.HEALTH_STATE_WARNING: Health.WARNING, common_pb2.HEALTH_STATE_CRITICAL: Health.CRITICAL}


def instance_of(e: common_pb2.Endpoint) -> ServiceInstance | None:
    role = PB_ROLE.get(e.role)
    host, sep, port = e.address.rpartition(":")
    if role is None or not sep or not port.isdigit():
        return None
    return ServiceInstance(
        e.id,
        role,
        e.zone or "-",
        e.version,
        host,
        int(port),
        PB_HEALTH.get(e.health, Health.PASSING),
        meta=dict(e.meta),
    )


@dataclass(frozen=True)
class EndpointSet:
    """One revision of the endpoint sets: instances, router weights, zone weights."""

    revision: int
    instances: tuple[ServiceInstance, ...]
    router_weights: dict[str, float]
    zone_weights: dict[str, float]
    stale: bool = False
    zone_healthy: dict[str, bool] = field(default_factory=dict)

    @staticmethod
    def from_response(resp: failover_pb2.WatchEndpointsResponse) -> EndpointSet:
        insts = [i for z in resp.zones for e in z.endpoints if (i := instance_of(e)) is not None]
        zw = {z.zone: z.weight for z in resp.zones}
        views = build_zone_views(CatalogSnapshot.of(insts), ZonePolicy(min_worker_fraction=0.0))
        rw = router_weights(views, zw, dict(resp.version_weights) or {"": 1.0})
        return EndpointSet(resp.revision, tuple(insts), rw, zw, resp.stale, {z.zone: z.healthy for z in resp.zones})

    @staticmethod
    def static(router_targets: list[str]) -> EndpointSet:
        """A bootstrap set of routers known by address only (equal weights)."""
        insts = tuple(ServiceInstance(t, Role.ROUTER, "-", "", *_split(t)) for t in router_targets)
        n = len(insts)
        return EndpointSet(0, insts, {i.id: 1.0 / n for i in insts} if n else {}, {})

    def by_id(self) -> dict[str, ServiceInstance]:
        return {i.id: i for i in self.instances}

    def of_role(self, role: Role) -> list[ServiceInstance]:
        return [i for i in self.instances if i.role is role]

    def pick(
        self, u: float, exclude: frozenset[str] = frozenset(), prefer_zone: str = "", u_zone: float = 0.0
    ) -> ServiceInstance | None:
        """A router drawn by weight (`u` uniform in [0, 1)). With `prefer_zone` (a client's own zone), that
        zone's routers are drawn alone with probability w(zone) / max over zones of w (router weights summed
        per zone; `u_zone` is the draw): 1 while every zone takes its full share, rising with the failover
        service's ramp after a failback, 0 while the zone is down."""
        by = self.by_id()
        cands = [(rid, w) for rid, w in sorted(self.router_weights.items()) if w > 0 and rid not in exclude]
        if not cands:
            rest = sorted(i.id for i in self.of_role(Role.ROUTER) if i.id not in exclude)
            cands = [(rid, 1.0) for rid in rest]
        if prefer_zone and cands:
            per_zone: dict[str, float] = {}
            for rid, w in cands:
                per_zone[by[rid].zone] = per_zone.get(by[rid].zone, 0.0) + w
            local = [(rid, w) for rid, w in cands if by[rid].zone == prefer_zone]
            if local and u_zone < per_zone[prefer_zone] / max(per_zone.values()):
                cands = local
        total = sum(w for _, w in cands)
        if not cands or total <= 0:
            return None
        acc = 0.0
        target = min(max(u, 0.0), 1.0 - 1e-12) * total
        for rid, w in cands:
            acc += w
            if target < acc:
                return by[rid]
        return by[cands[-1][0]]


def _split(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host, int(port)
