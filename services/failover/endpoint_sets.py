"""Endpoint-set publisher: DiscoveryWatcher → FailoverPolicy → published revisions of the endpoint sets.

Each watcher change, and every `tick_s` otherwise (hysteresis and ramps need time to pass), one
observation is fed to the pure policy. When the published content (zones, health, endpoints,
weights rounded to 1e-4, stale flag) differs from the last one the revision increases and watchers
are woken. Traffic-weight changes push ``(zone_plan, version_plan)`` on a bounded stack so that one
rollback restores both maps as they were before the last change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from kvmesh.core.changes import ChangeCounter
from kvmesh.core.errors import FailedPrecondition
from kvmesh.core.tasks import stop_task
from kvmesh.discovery.model import Role
from kvmesh.discovery.policy import Decision, FailoverPolicy
from kvmesh.discovery.traffic import HISTORY_LIMIT, TrafficPlan, version_shares
from kvmesh.discovery.watcher import DiscoveryWatcher
from kvmesh.services.failover import metrics

log = logging.getLogger(__name__)


class EndpointSetPublisher:
    def __init__(
        self,
        watcher: DiscoveryWatcher,
        policy: FailoverPolicy,
        tick_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.watcher = watcher
        self.policy = policy
        self.tick_s = tick_s
        self.clock = clock
        self.decision: Decision = policy.observe(watcher.snapshot, clock())
        self._changes = ChangeCounter(1)
        self._key: Any = None
        self._history: list[tuple[TrafficPlan, TrafficPlan]] = []
        self._task: asyncio.Task[None] | None = None

    @property
    def stale(self) -> bool:
        return self.watcher.reachable is False or self.watcher.source == "last-known-good"

    async def start(self) -> None:
        await self._evaluate()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            await stop_task(self._task)

    @property
    def revision(self) -> int:
        """Bumped whenever the served endpoint sets or weights change."""
        return self._changes.value

    async def wait_revision(self, seen: int, timeout_s: float) -> int:
        return await self._changes.wait_changed(seen, timeout_s)

    async def _run(self) -> None:
        version = self.watcher.version
        while True:
            version = await self.watcher.changed(version, self.tick_s)
            await self._evaluate()

    async def _evaluate(self) -> None:
        d = self.policy.observe(self.watcher.snapshot, self.clock())
        self._rewarm_ended(self.decision, d)
        self.decision = d
        for tr in d.transitions:
            direction = "up" if tr.healthy else "down"
            metrics.SWITCHOVERS.labels(tr.zone, direction).inc()
            metrics.SWITCHOVER_SECONDS.labels(direction).observe(tr.duration_s)
            log.warning(
                "zone %s is now %s after %.3fs (reasons: %s)",
                tr.zone,
                "healthy" if tr.healthy else "UNHEALTHY",
                tr.duration_s,
                "; ".join(tr.reasons) or "-",
            )
        self._export(d)
        key = self._content_key(d)
        if key != self._key:
            self._key = key
            metrics.REVISION.set(self._changes.bump())

    def _rewarm_ended(self, before: Decision, after: Decision) -> None:
        """Logs and times each restored zone whose ramp started in this observation: at once (nothing was
        pending for it: a 0 s hold) or at the end of its re-warm hold."""
        for z, st in after.states.items():
            prev = before.states.get(z)
            if prev is None or prev.ramp_from is not None or st.ramp_from is None or st.restored_at is None:
                continue
            waited = st.ramp_from - st.restored_at
            pending = after.views[z].rewarm_from if z in after.views else ()
            metrics.REWARM_HOLD_SECONDS.labels("timeout" if pending else "warm").observe(waited)
            if pending:
                log.warning("zone %s ramps up un-warmed after %.1fs: pending from %s", z, waited, ", ".join(pending))
            else:
                log.info("zone %s re-warmed by the other zones %.1fs after its restore; ramping up", z, waited)

    def version_weights(self) -> dict[str, float]:
        """Effective version shares among versions with an up router in a zone carrying traffic."""
        present = {
            r.version
            for z, v in self.decision.views.items()
            if self.decision.zone_weights.get(z, 0) > 0
            for r in v.routers
        }
        shares = version_shares(self.policy.version_plan.weights, present)
        return shares or dict(self.policy.version_plan.weights)

    def _content_key(self, d: Decision) -> Any:
        zones = tuple(
            (
                z,
                d.states[z].healthy,
                round(d.zone_weights.get(z, 0.0), 4),
                tuple(
                    (i.id, i.health.value, i.target) for i in (*v.routers, *v.cache_managers, *v.workers, *v.failovers)
                ),
            )
            for z, v in sorted(d.views.items())
        )
        vw = tuple(sorted((k, round(w, 4)) for k, w in self.version_weights().items()))
        return zones, vw, self.stale

    def _export(self, d: Decision) -> None:
        for z, st in d.states.items():
            metrics.ZONE_HEALTHY.labels(z).set(1 if st.healthy else 0)
            metrics.ZONE_WEIGHT.labels(z).set(d.zone_weights.get(z, 0.0))
            metrics.ZONE_REWARM_HOLD.labels(z).set(1 if st.rewarm_hold else 0)
            v = d.views.get(z)
            if v is not None:
                for role, items in (
                    (Role.ROUTER, v.routers),
                    (Role.CACHE_MANAGER, v.cache_managers),
                    (Role.WORKER, v.workers),
                    (Role.FAILOVER, v.failovers),
                ):
                    metrics.ENDPOINTS.labels(z, role.value).set(len(items))
        for ver, w in self.policy.version_plan.weights.items():
            metrics.VERSION_WEIGHT.labels(ver).set(w)
        metrics.REGISTRY_REACHABLE.set(1 if self.watcher.reachable else 0)
        metrics.SERVING_STALE.set(1 if self.stale else 0)

    # -- traffic weights -----------------------------------------------------------------------
    async def set_weights(self, zone_w: Mapping[str, float], version_w: Mapping[str, float]) -> None:
        """Validate both maps first (InvalidArgument leaves everything unchanged), then apply atomically."""
        zp = self.policy.zone_plan.set("zone_weights", zone_w) if zone_w else self.policy.zone_plan
        vp = self.policy.version_plan.set("version_weights", version_w) if version_w else self.policy.version_plan
        self._history = [*self._history, (self.policy.zone_plan, self.policy.version_plan)][-HISTORY_LIMIT:]
        self.policy.zone_plan, self.policy.version_plan = zp, vp
        log.info("traffic weights set: zones %s, versions %s", dict(zp.weights), dict(vp.weights))
        await self._evaluate()

    async def rollback(self) -> None:
        if not self._history:
            raise FailedPrecondition("no previous traffic weights to roll back to")
        self.policy.zone_plan, self.policy.version_plan = self._history.pop()
        log.info(
            "traffic weights rolled back: zones %s, versions %s",
            dict(self.policy.zone_plan.weights),
            dict(self.policy.version_plan.weights),
        )
        await self._evaluate()
