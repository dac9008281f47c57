"""The failover decision: zone views + hysteresis + zone and version weights (pure, `now` passed in).

Router endpoint weights combine the version split (global) with the zone split:

    P(router e of version v in zone z) = s_v * (w_z / sum_{z' has v} w_z') / n(z, v)

where ``s_v`` are the version shares among versions with an up router in a zone of positive
weight (`traffic.version_shares`), ``w_z`` the zone weights (`zones.zone_weights`) and ``n(z, v)``
the number of up routers of version v in zone z. The probabilities sum to 1 (or the map is empty).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvmesh.discovery.model import CatalogSnapshot
from kvmesh.discovery.traffic import TrafficPlan, version_shares
from kvmesh.discovery.zones import (
    ZonePolicy,
    ZoneState,
    ZoneTransition,
    ZoneView,
    build_zone_views,
    step_zone,
    zone_weights,
)


def router_weights(
    views: Mapping[str, ZoneView], zone_w: Mapping[str, float], version_w: Mapping[str, float]
) -> dict[str, float]:
    """Per-router selection probabilities (formula in the module docstring), keyed by instance id."""
    live = {z: v for z, v in views.items() if zone_w.get(z, 0.0) > 0 and v.routers}
    present = {r.version for v in live.values() for r in v.routers}
    shares = version_shares(version_w, present)
    out: dict[str, float] = {}
    for ver, s in shares.items():
        zones = {z: zone_w[z] for z, v in live.items() if any(r.version == ver for r in v.routers)}
        ztotal = sum(zones.values())
        for z, wz in zones.items():
            rs = [r for r in live[z].routers if r.version == ver]
            for r in rs:
                out[r.id] = s * (wz / ztotal) / len(rs)
    return out


@dataclass(frozen=True)
class Decision:
    """What the failover service publishes after one observation."""

    at: float
    views: Mapping[str, ZoneView]
    states: Mapping[str, ZoneState]
    zone_weights: Mapping[str, float]
    router_weights: Mapping[str, float]
    transitions: tuple[ZoneTransition, ...]
    zone_generation: int
    version_generation: int


@dataclass
class FailoverPolicy:
    """Stateful wrapper over the pure functions; every method takes `now` explicitly."""

    policy: ZonePolicy
    zone_plan: TrafficPlan
    version_plan: TrafficPlan
    zones: tuple[str, ...] = ()
    default_zone_weight: float = 0.0
    states: dict[str, ZoneState] = field(default_factory=dict)
    snapshot: CatalogSnapshot = field(default_factory=CatalogSnapshot)

    @staticmethod
    def create(
        policy: ZonePolicy,
        zone_weights: Mapping[str, float],
        version_weights: Mapping[str, float],
        zones: Iterable[str] = (),
        default_zone_weight: float = 0.0,
    ) -> FailoverPolicy:
        """`default_zone_weight`: base weight of a zone absent from `zone_weights` (0 = standby)."""
        return FailoverPolicy(
            policy,
            TrafficPlan.initial("zone_weights", zone_weights),
            TrafficPlan.initial("version_weights", version_weights),
            tuple(sorted(set(zones) | set(zone_weights))),
            default_zone_weight,
        )

    def observe(self, snapshot: CatalogSnapshot, now: float) -> Decision:
        """One observation of the catalog (a watch result, or a periodic tick with the same snapshot)."""
        self.snapshot = snapshot
        views = build_zone_views(snapshot, self.policy, self.zones)
        transitions: list[ZoneTransition] = []
        for z, view in views.items():
            state, tr = step_zone(self.states.get(z), view, self.policy, now)
            self.states[z] = state
            if tr is not None:
                transitions.append(tr)
        return self._decide(views, now, tuple(transitions))

    def set_zone_weights(self, weights: Mapping[str, float]) -> None:
        self.zone_plan = self.zone_plan.set("zone_weights", weights)

    def set_version_weights(self, weights: Mapping[str, float]) -> None:
        self.version_plan = self.version_plan.set("version_weights", weights)

    def rollback_versions(self) -> None:
        self.version_plan = self.version_plan.rollback()

    def _decide(self, views: Mapping[str, ZoneView], now: float, transitions: tuple[ZoneTransition, ...]) -> Decision:
        zw = zone_weights(self.states, views, self.zone_plan.weights, self.policy, now, self.default_zone_weight)
        rw = router_weights(views, zw, self.version_plan.weights)
        return Decision(
            now,
            dict(views),
            dict(self.states),
            zw,
            rw,
            transitions,
            self.zone_plan.generation,
            self.version_plan.generation,
        )
