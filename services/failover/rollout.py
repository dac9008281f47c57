"""Rollout controller: drives `kvmesh.ops.rollout.schedule` with verdicts of `kvmesh.ops.rollout.canary`.

`start(new, old)` remembers the version weights in force, sets the first step and runs one task that, every
check interval, measures both versions (`canary_probe.VersionProber`, workers of each version from the
published endpoint sets), analyses, and applies the schedule's action through the endpoint-set publisher:
the next step's weights, or the weights from before the rollout (automatic rollback). Every event is logged,
exempt from the log repeat limit (a rollback at WARNING, with its reasons), and counted in the
`kvmesh_rollout_*` metrics. One rollout at a time; the last one stays readable (`current`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvmesh.core.errors import FailedPrecondition
from kvmesh.core.tasks import stop_task
from kvmesh.ops.rollout.canary import CanaryThresholds, Verdict, analyse
from kvmesh.ops.rollout.schedule import Action, Phase, Rollout, RolloutPlan, abort, start, step
from kvmesh.services.failover import metrics
from kvmesh.services.failover.canary_probe import VersionProber
from kvmesh.services.failover.endpoint_sets import EndpointSetPublisher
from kvmesh.telemetry.logging import UNLIMITED

log = logging.getLogger(__name__)


class RolloutController:
    def __init__(
        self,
        publisher: EndpointSetPublisher,
        prober: VersionProber,
        plan: RolloutPlan,
        thresholds: CanaryThresholds,
        check_interval_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.publisher = publisher
        self.prober = prober
        self.plan = plan.validated()
        self.thresholds = thresholds.validated()
        self.check_interval_s = check_interval_s
        self.clock = clock
        self.current: Rollout | None = None
        self._before: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self, new_version: str, old_version: str) -> Rollout:
        """Starts a rollout (FailedPrecondition while one is running; InvalidArgument for bad versions)."""
        if self.current is not None and self.current.phase is Phase.RUNNING:
            raise FailedPrecondition(f"rollout of {self.current.new_version} is running")
        r = start(new_version, old_version, self.plan, self.clock())
        if self._task is not None:  # a promoted rollout's standby watch
            await stop_task(self._task)
        self._before = dict(self.publisher.policy.version_plan.weights)
        await self.publisher.set_weights({}, r.weights())
        self._record(r, 0)
        self._task = asyncio.create_task(self._run())
        return r

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
        await self.prober.close()

    async def _run(self) -> None:
        try:
            await self._loop()
        except Exception as e:  # a bug or an unexpected failure: fail safe, never leave a canary half-weighted
            log.exception("rollout controller failed")
            if self.current is not None and self.current.phase is Phase.RUNNING:
                await self.publisher.set_weights({}, self._before)
                metrics.ROLLOUT_ROLLBACKS.labels("controller").inc()
                self._record(
                    abort(self.current, f"controller error {type(e).__name__}: {e}", self.clock()),
                    len(self.current.events),
                )

    async def _loop(self) -> None:
        while self.current is not None and self.current.phase in (Phase.RUNNING, Phase.PROMOTED):
            r = self.current
            wait = self.check_interval_s
            if r.phase is Phase.PROMOTED:
                wait = max(0.0, min(wait, r.standby_until - self.clock()))
            await asyncio.sleep(wait)
            verdict = await self._check(r) if r.phase is Phase.RUNNING else None
            nxt, action = step(r, verdict, self.clock())
            if action is Action.SET_WEIGHTS:
                await self.publisher.set_weights({}, nxt.weights())
                if nxt.phase is Phase.PROMOTED:
                    metrics.ROLLOUT_PROMOTIONS.inc()
            elif action is Action.ROLLBACK:
                await self.publisher.set_weights({}, self._before)
                metrics.ROLLOUT_ROLLBACKS.labels(nxt.verdict.failed[0] if nxt.verdict else "unknown").inc()
            self._record(nxt, len(r.events))

    async def _check(self, r: Rollout) -> Verdict:
        views = self.publisher.decision.views.values()
        workers = {
            v: [w for view in views for w in view.workers if w.version == v] for v in (r.old_version, r.new_version)
        }
        samples = await self.prober.measure(workers)
        verdict = analyse(samples[r.old_version], samples[r.new_version], self.thresholds)
        if verdict.passed:
            metrics.ROLLOUT_VERDICTS.labels("pass", "none").inc()
        for check in verdict.failed:
            metrics.ROLLOUT_VERDICTS.labels("fail", check).inc()
        metrics.ROLLOUT_CONSISTENCY.set(verdict.consistency)
        metrics.ROLLOUT_LATENCY_REGRESSION.set(verdict.latency_regression)
        log.info(
            "canary check of %s at %g %%: %s (consistency %.4f, latency %+.1f %%, memory %.1f %%)",
            r.new_version,
            100 * r.new_share,
            "pass" if verdict.passed else "FAIL " + "; ".join(verdict.reasons),
            verdict.consistency,
            100 * verdict.latency_regression,
            100 * verdict.memory_diff,
        )
        return verdict

    def _record(self, r: Rollout, seen_events: int) -> None:
        self.current = r
        metrics.ROLLOUT_STEP.labels(r.new_version).set(100 * r.new_share)
        for ev in r.events[seen_events:]:
            level = logging.WARNING if ev.kind == "rolled_back" else logging.INFO
            log.log(level, "rollout event %s: %s", ev.kind, ev.message, extra={UNLIMITED: True})  # a few per step
