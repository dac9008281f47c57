"""Zone health policy (pure: the caller passes `now`; no clock, no I/O).

1. **Endpoint sets.** An instance is *up* when its health is passing (or warning, with
   ``warning_is_up``). Each zone's view lists its up routers, cache-managers, workers, failovers.
2. **Raw zone health.** A zone is healthy iff it has >= 1 up router, >= 1 up cache-manager (unless
   ``require_cache_manager`` is off) and
   ``up_capacity / total_capacity >= min_worker_fraction`` where ``total_capacity =
   max(sum of registered worker capacity in the zone, expected_capacity[zone])``.
3. **Hysteresis.** The effective state flips only after the raw state has disagreed with it for
   ``n`` consecutive observations *and* for ``hold_s`` seconds (``down_*`` when failing,
   ``up_*`` when recovering); recovering also needs ``now - since >= min_dwell_s`` (time spent
   down). Failing is never delayed by the dwell: traffic must leave a dead zone at once.
4. **Gradual come-back, after the re-warm.** A zone that recovered at ``t_r`` first holds at
   ``r = ramp_floor`` while another zone's up cache-manager still lists it in its
   ``replication_pending`` meta (it has not yet replicated its hot prefixes into the returning zone,
   or has not yet re-read that zone's index), at most ``rewarm_timeout_s`` (0: no hold). The hold ends
   at ``t_w`` (``t_w = t_r`` when nothing is pending); then
   ``r(now) = min(1, ramp_floor + (1 - ramp_floor) * (now - t_w) / ramp_s)``; 1 when never down.
5. **Zone weights.** ``eff_z = base_z * r_z`` for healthy zones, 0 otherwise;
   ``weight_z = eff_z / sum(eff)``. So an unhealthy zone's share is redistributed to the healthy
   ones in proportion to their base weights. If ``sum(eff) = 0``: healthy zones share equally
   (standby zones take over); if none is healthy: zones with an up router share equally
   (degraded, fail-open); otherwise all weights are 0.
6. **Starting.** A zone first seen unhealthy is *starting*, not failed, until it first turns healthy or
   ``start_grace_s`` after that first observation: it takes no traffic either, but its reason says what
   it waits for (``starting_reason``: workers loading, a service not up yet, no health report yet).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.core.errors import InvalidArgument
from kvmesh.discovery.model import REPLICATION_PENDING_META, CatalogSnapshot, Health, Role, ServiceInstance


@dataclass(frozen=True)
class ZonePolicy:
    """Tunables of the zone policy; see the module docstring for the formulas."""

    min_worker_fraction: float = 0.5
    require_cache_manager: bool = True
    warning_is_up: bool = True
    down_observations: int = 1
    down_hold_s: float = 0.0
    up_observations: int = 2
    up_hold_s: float = 2.0
    min_dwell_s: float = 5.0
    ramp_s: float = 30.0
    ramp_floor: float = 0.05
    rewarm_timeout_s: float = 60.0
    start_grace_s: float = 600.0
    expected_capacity: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_worker_fraction <= 1.0:
            raise InvalidArgument("min_worker_fraction", "must be in [0, 1]")
        for name in ("down_observations", "up_observations"):
            if getattr(self, name) < 1:
                raise InvalidArgument(name, "must be >= 1")
        for name in ("down_hold_s", "up_hold_s", "min_dwell_s", "ramp_s", "rewarm_timeout_s", "start_grace_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise InvalidArgument(name, "must be a finite number >= 0")
        if not 0.0 <= self.ramp_floor <= 1.0:
            raise InvalidArgument("ramp_floor", "must be in [0, 1]")
        for z, c in self.expected_capacity.items():
            if not (math.isfinite(c) and c >= 0):
                raise InvalidArgument(f"expected_capacity[{z}]", "must be a finite number >= 0")


@dataclass(frozen=True)
class ZoneView:
    """Endpoint sets of one zone (up instances only, sorted by id) and its raw health."""

    zone: str
    routers: tuple[ServiceInstance, ...]
    cache_managers: tuple[ServiceInstance, ...]
    workers: tuple[ServiceInstance, ...]
    failovers: tuple[ServiceInstance, ...]
    worker_capacity_up: float
    worker_capacity_total: float
    healthy: bool
    reasons: tuple[str, ...]
    rewarm_from: tuple[str, ...] = ()  # zones still replicating into this one (`REPLICATION_PENDING_META`)
    starting_reason: str = ""  # what the zone waits for, phrased for a zone still starting (`starting_reason`)


def is_up(inst: ServiceInstance, policy: ZonePolicy) -> bool:
    return inst.health is Health.PASSING or (policy.warning_is_up and inst.health is Health.WARNING)


def build_zone_views(snapshot: CatalogSnapshot, policy: ZonePolicy, zones: Iterable[str] = ()) -> dict[str, ZoneView]:
    """Per-zone views for every zone in the snapshot, in `zones` and in ``policy.expected_capacity``."""
    names = set(snapshot.zones()) | set(zones) | set(policy.expected_capacity)
    rewarming = pending_replication(snapshot, policy)
    out: dict[str, ZoneView] = {}
    for z in sorted(names):
        members = [i for i in snapshot.instances if i.zone == z]
        up = [i for i in members if is_up(i, policy)]

        def of(role: Role, pool: list[ServiceInstance] = up) -> tuple[ServiceInstance, ...]:
            return tuple(i for i in pool if i.role is role)

        cap_up = sum(i.capacity for i in of(Role.WORKER))
        cap_total = max(sum(i.capacity for i in of(Role.WORKER, members)), policy.expected_capacity.get(z, 0))
        reasons: list[str] = []
        if not of(Role.ROUTER):
            reasons.append("no passing router")
        if policy.require_cache_manager and not of(Role.CACHE_MANAGER):
            reasons.append("no passing cache-manager")
        if cap_total <= 0:
            reasons.append("no workers registered")
        elif cap_up / cap_total < policy.min_worker_fraction:
            reasons.append(f"worker capacity {cap_up:g}/{cap_total:g} below fraction {policy.min_worker_fraction:g}")
        out[z] = ZoneView(
            z,
            of(Role.ROUTER),
            of(Role.CACHE_MANAGER),
            of(Role.WORKER),
            of(Role.FAILOVER),
            cap_up,
            cap_total,
            not reasons,
            tuple(reasons),
            tuple(sorted(rewarming.get(z, ()))),
            starting_reason(members, up, policy),
        )
    return out


def starting_reason(members: Sequence[ServiceInstance], up: Sequence[ServiceInstance], policy: ZonePolicy) -> str:
    """What a starting zone waits for, from its registered `members` and the `up` ones among them, e.g.
    "2 of 2 workers loading; cache-manager starting", or "no health report yet" when nothing is registered."""
    if not members:
        return "no health report yet"
    parts: list[str] = []
    for role, name in ((Role.ROUTER, "router"), (Role.CACHE_MANAGER, "cache-manager")):
        if role is Role.CACHE_MANAGER and not policy.require_cache_manager:
            continue
        if not any(i.role is role for i in up):
            registered = any(i.role is role for i in members)
            parts.append(f"{name} starting" if registered else f"no {name} registered yet")
    workers = sum(1 for i in members if i.role is Role.WORKER)
    loading = workers - sum(1 for i in up if i.role is Role.WORKER)
    if not workers:
        parts.append("no worker registered yet")
    elif loading:
        parts.append(f"{loading} of {workers} workers loading")
    return "; ".join(parts) or "up, confirming health"


def pending_replication(snapshot: CatalogSnapshot, policy: ZonePolicy) -> dict[str, set[str]]:
    """{zone: the other zones whose up cache-managers still list it in `REPLICATION_PENDING_META`}."""
    out: dict[str, set[str]] = {}
    for i in snapshot.instances:
        if i.role is not Role.CACHE_MANAGER or not is_up(i, policy):
            continue
        for z in filter(None, (p.strip() for p in i.meta.get(REPLICATION_PENDING_META, "").split(","))):
            if z != i.zone:
                out.setdefault(z, set()).add(i.zone)
    return out


@dataclass(frozen=True)
class ZoneState:
    """Debounced state of a zone. `pending_*` track the raw state disagreeing with `healthy`."""

    zone: str
    healthy: bool
    since: float
    pending_count: int = 0
    pending_since: float | None = None
    restored_at: float | None = None
    reasons: tuple[str, ...] = ()
    ramp_from: float | None = None  # when the ramp of a restored zone started (None: still held for re-warm)
    starting: bool = False  # not yet healthy since the first observation (`since`), within `start_grace_s`

    @property
    def rewarm_hold(self) -> bool:
        """A restored zone held at the ramp floor until the other zones have re-warmed it."""
        return self.healthy and self.restored_at is not None and self.ramp_from is None


@dataclass(frozen=True)
class ZoneTransition:
    """A flip of a zone's effective state; ``duration_s = at - detected_at`` (debounce delay)."""

    zone: str
    healthy: bool
    detected_at: float
    at: float
    reasons: tuple[str, ...]

    @property
    def duration_s(self) -> float:
        return self.at - self.detected_at


def step_zone(
    prev: ZoneState | None, view: ZoneView, policy: ZonePolicy, now: float
) -> tuple[ZoneState, ZoneTransition | None]:
    """Advance one zone's hysteresis (and a restored zone's re-warm hold) by one observation taken at `now`."""
    if prev is None:
        return ZoneState(view.zone, view.healthy, now, reasons=view.reasons, starting=not view.healthy), None
    starting = prev.starting and now - prev.since < policy.start_grace_s
    if view.healthy == prev.healthy:
        ramp_from = _ramp_start(prev.restored_at, prev.ramp_from, view, policy, now)
        state = ZoneState(
            prev.zone, prev.healthy, prev.since, 0, None, prev.restored_at, view.reasons, ramp_from, starting
        )
        return state, None
    count = prev.pending_count + 1
    pending_since = prev.pending_since if prev.pending_since is not None else now
    held = now - pending_since
    if view.healthy:
        flip = count >= policy.up_observations and held >= policy.up_hold_s and now - prev.since >= policy.min_dwell_s
    else:
        flip = count >= policy.down_observations and held >= policy.down_hold_s
    if not flip:
        return ZoneState(
            prev.zone,
            prev.healthy,
            prev.since,
            count,
            pending_since,
            prev.restored_at,
            view.reasons,
            prev.ramp_from,
            starting,
        ), None
    restored_at = now if view.healthy else None
    ramp_from = _ramp_start(restored_at, None, view, policy, now)
    state = ZoneState(prev.zone, view.healthy, now, 0, None, restored_at, view.reasons, ramp_from)
    return state, ZoneTransition(prev.zone, view.healthy, pending_since, now, view.reasons)


def zone_reason(state: ZoneState, view: ZoneView) -> str:
    """Why a zone is in its state, for operators: what a starting zone waits for; why an unhealthy zone is out (or
    that it looks healthy again but is not yet confirmed); empty for a healthy zone."""
    if state.starting:
        return view.starting_reason
    if not state.healthy and view.healthy:
        return "recovering, not yet confirmed healthy"
    return "; ".join(view.reasons)


def _ramp_start(
    restored_at: float | None, ramp_from: float | None, view: ZoneView, policy: ZonePolicy, now: float
) -> float | None:
    """When a restored zone's ramp starts: once nothing is pending for it, or `rewarm_timeout_s` after its
    restore; None while it is held (and for a zone never restored)."""
    if restored_at is None or ramp_from is not None:
        return ramp_from
    if not view.rewarm_from or now - restored_at >= policy.rewarm_timeout_s:
        return now
    return None


def ramp_factor(state: ZoneState, policy: ZonePolicy, now: float) -> float:
    """``r(now)`` of the module docstring; 0 for an unhealthy zone."""
    if not state.healthy:
        return 0.0
    if state.rewarm_hold:
        return policy.ramp_floor
    if state.restored_at is None or state.ramp_from is None or policy.ramp_s <= 0:
        return 1.0
    frac = (now - state.ramp_from) / policy.ramp_s
    return max(0.0, min(1.0, policy.ramp_floor + (1.0 - policy.ramp_floor) * frac))


def zone_weights(
    states: Mapping[str, ZoneState],
    views: Mapping[str, ZoneView],
    base: Mapping[str, float],
    policy: ZonePolicy,
    now: float,
    default_base: float = 0.0,
) -> dict[str, float]:
    """Effective zone weights (sum 1, or all 0 when nothing can serve); see the module docstring.

    A zone missing from `base` has base weight `default_base` (0: standby).
    """
    zones = sorted(states)
    eff = {z: base.get(z, default_base) * ramp_factor(states[z], policy, now) for z in zones}
    total = sum(eff.values())
    if total > 0:
        return {z: w / total for z, w in eff.items()}
    chosen = [z for z in zones if states[z].healthy]
    if not chosen:
        chosen = [z for z in zones if z in views and views[z].routers]
    return {z: (1.0 / len(chosen) if z in chosen else 0.0) for z in zones}
