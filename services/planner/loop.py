"""The planning step of every zone: read the router, decide, carry out (the I/O around kvmesh.ops.planner).

Per zone, every ``interval_s``: ``ListWorkers`` on the zone's router gives each worker's request counter
(``selections_total``, the history), its queue (``load.waiting``) and whether it serves; the zone's
:class:`~kvmesh.ops.planner.zone.ZonePlanner` decides; a scale-out starts workers in the background (they count
as starting until the router lists them as passing); a scale-in drains the chosen workers through the
router (``DrainWorker``) and stops each once the router has nothing in flight on it and its queue is empty
(or after ``drain_timeout_s``), so no request is lost. A disaggregated zone (``--pools``) is also sized pool by
pool, each worker's role read from the router's listing (its endpoint's `worker_role` meta; a worker without
one is ``both``); a role change drains the worker the same way and, once drained, the actuator stops it and
starts a worker of the other role in its place (an actuator that cannot start a given role, and dry-run,
only log and count it: ``kvmesh_planner_actions_total{action="role_change_dry_run"}``).
The history is checkpointed after every step. Each
zone's last decision, forecast and step error, and its recent decisions that did or refused something (`Step`,
at most `DECISIONS_KEPT`, one repeated step after step kept once), are what `PlannerService/GetPlan`
(`kvmesh planner`) shows.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.core.config import ServerSettings
from kvmesh.core.handoff import WorkerRole
from kvmesh.discovery.model import WORKER_ROLE_META
from kvmesh.ops.planner.history import LoadHistory
from kvmesh.ops.planner.sizing import WorkerLife
from kvmesh.ops.planner.zone import Decision, ZonePlanner
from kvmesh.rpc.channel import open_channel
from kvmesh.services.planner import metrics as m
from kvmesh.services.planner.actuators import Actuator
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger(__name__)
PASSING = common_pb2.HEALTH_STATE_PASSING


DECISIONS_KEPT = 200  # recent decisions that did or refused something, per zone


@dataclass(frozen=True)
class Step:
    """One planning step of a zone, as `kvmesh planner` shows it."""

    at: float
    decision: Decision
    serving: int
    starting: int
    queued: int
    worker_ids: Mapping[str, str] = field(default_factory=dict)  # its role changes' workers: address → id

    def same_as(self, other: Step) -> bool:
        """The same decision on the same fleet (the time and the forecast's figures aside)."""
        a, b = self.decision, other.decision
        return (a.action, a.desired, self.serving, self.starting, _split(a)) == (
            b.action,
            b.desired,
            other.serving,
            other.starting,
            _split(b),
        )

    @property
    def did_or_refused(self) -> bool:
        """Whether it scaled, changed a role, or said why it did not (what `kvmesh planner` lists)."""
        a, pools = self.decision.action, self.decision.pools
        return bool(a.add or a.remove or a.reason or (pools is not None and (pools.changes or pools.reason)))


def _split(d: Decision) -> tuple[object, ...]:
    """A decision's pool sizing without the forecast's figures."""
    p = d.pools
    return () if p is None else (p.targets.prefill, p.targets.decode, p.prefill, p.decode, p.changes, p.reason)


@dataclass
class ZoneRuntime:
    """What the loop tracks for one zone besides its planner."""

    planner: ZonePlanner
    stub: router_pb2_grpc.RouterAdminServiceStub
    last: Step | None = None
    steps: deque[Step] = field(default_factory=lambda: deque(maxlen=DECISIONS_KEPT))
    error: str = ""  # the last step's failure ("" when it succeeded)
    starting: set[asyncio.Task[str]] = field(default_factory=set)
    announced: set[str] = field(default_factory=set)  # ids of started workers not yet passing at the router
    started_at: dict[str, float] = field(default_factory=dict)  # address → when it first served
    draining: dict[str, tuple[str, float]] = field(default_factory=dict)  # address → (worker id, since)
    restart_as: dict[str, WorkerRole] = field(default_factory=dict)  # draining address → the role it restarts as
    # a role change's worker from its stop until the router lists it passing: its start task, then its id
    changing: dict[asyncio.Task[str] | str, WorkerRole] = field(default_factory=dict)

    def incoming(self) -> dict[WorkerRole, int]:
        """Workers on their way into a pool by a role change (draining, restarting, not yet passing)."""
        out: dict[WorkerRole, int] = {}
        for role in [*self.restart_as.values(), *self.changing.values()]:
            out[role] = out.get(role, 0) + 1
        return out


class PlannerLoop:
    def __init__(
        self,
        planners: dict[str, ZonePlanner],
        routers: dict[str, str],
        actuator: Actuator,
        settings: ServerSettings,
        history_file: str = "",
        drain_timeout_s: float = 120.0,
    ) -> None:
        self.actuator = actuator
        self.history_file = history_file
        self.drain_timeout_s = drain_timeout_s
        self.zones = {
            z: ZoneRuntime(p, router_pb2_grpc.RouterAdminServiceStub(open_channel(routers[z], settings)))
            for z, p in planners.items()
        }

    def restore(self) -> None:
        """Loads the history checkpoint, if there is one (a bad one is refused, naming the field)."""
        if not self.history_file or not Path(self.history_file).exists():
            return
        data = json.loads(Path(self.history_file).read_text())
        for zone, h in data.get("zones", {}).items():
            if zone in self.zones:
                planner = self.zones[zone].planner
                planner.history = LoadHistory.from_json(h, planner.history.max_buckets)

    def checkpoint(self) -> None:
        if not self.history_file:
            return
        doc = {"zones": {z: rt.planner.history.to_json() for z, rt in self.zones.items()}}
        tmp = Path(self.history_file + ".tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.history_file)

    async def step(self) -> None:
        for zone, rt in self.zones.items():
            try:
                await self._zone_step(zone, rt, time.time())
                rt.error = ""
            except Exception as exc:
                m.STEP_ERRORS.labels(zone).inc()
                rt.error = f"{type(exc).__name__}: {exc}"
                log.exception("planning step of zone %s failed", zone)
        self.checkpoint()

    async def _zone_step(self, zone: str, rt: ZoneRuntime, now: float) -> None:
        resp = await rt.stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5.0)
        rt.planner.history.observe(now, {w.endpoint.id: float(w.selections_total) for w in resp.workers})
        if await asyncio.to_thread(rt.planner.maybe_retrain, now):
            self._report_forecasters(zone, rt.planner)
        status = {w.endpoint.address: w for w in resp.workers}
        await self._finish_drains(zone, rt, status, now)
        passing = [a for a, w in status.items() if w.endpoint.health == PASSING and not w.draining]
        for a in passing:
            rt.started_at.setdefault(a, now)
        serving = [WorkerLife(a, rt.started_at[a]) for a in passing if a not in rt.draining]
        queued = sum(w.load.waiting for w in resp.workers)
        rt.announced -= {status[a].endpoint.id for a in passing}
        for wid in {status[a].endpoint.id for a in passing}:
            rt.changing.pop(wid, None)
        removable = self.actuator.removable(zone) if self.actuator.carries_out else None
        starting = len(rt.starting) + len(rt.announced) + len(rt.restart_as)  # a role change's worker returns
        d = rt.planner.step(now, serving, starting, queued, removable, roles_of(resp.workers), rt.incoming())
        changed = {c.worker_id for c in d.pools.changes} if d.pools is not None else set()
        step = Step(now, d, len(serving), starting, queued, {a: status[a].endpoint.id for a in changed})
        if step.did_or_refused and not (rt.steps and rt.steps[-1].same_as(step)):
            rt.steps.append(step)  # a decision repeated step after step (a dry run's) is kept once, when it began
        rt.last = step
        await self._carry_out(zone, rt, d, status, now)
        m.DESIRED.labels(zone).set(d.desired)
        m.SERVING.labels(zone).set(len(serving))
        m.STARTING.labels(zone).set(len(rt.starting) + len(rt.announced))
        m.FORECAST_RPS.labels(zone).set(d.forecast_rps)
        if d.pools is not None:
            t = d.pools.targets
            for role, want, have in (("prefill", t.prefill, d.pools.prefill), ("decode", t.decode, d.pools.decode)):
                m.POOL_DESIRED.labels(zone, role).set(want)
                m.POOL_SERVING.labels(zone, role).set(have)

    def _report_forecasters(self, zone: str, planner: ZonePlanner) -> None:
        cmp = planner.comparison
        if cmp is None:
            return
        scores = {"lstm": cmp.lstm_mae, **cmp.baselines}
        for name, err in scores.items():
            m.FORECAST_MAE.labels(zone, name).set(err)
            m.FORECASTER.labels(zone, name).set(1.0 if name == cmp.chosen else 0.0)
        log.info("zone %s: forecaster %s (held-out MAE %s)", zone, cmp.chosen, scores)

    async def _carry_out(
        self, zone: str, rt: ZoneRuntime, d: Decision, status: dict[str, router_pb2.WorkerStatus], now: float
    ) -> None:
        a = d.action
        if a.add or a.remove:
            log.info(
                "zone %s: %s (desired %d, forecast %.3f rps, %s)", zone, a, d.desired, d.forecast_rps, d.forecaster
            )
        changes = d.pools.changes if d.pools is not None else ()
        for c in changes:
            log.info("zone %s: role change of %s: %s -> %s (%s)", zone, c.worker_id, c.from_role, c.to_role, d.pools)
        if not self.actuator.carries_out or not self.actuator.changes_roles:
            for _ in changes:
                m.ACTIONS.labels(zone, "role_change_dry_run").inc()
            changes = ()
        if not self.actuator.carries_out:
            for _ in range(a.add):
                m.ACTIONS.labels(zone, "scale_out_dry_run").inc()
            for _ in a.remove:
                m.ACTIONS.labels(zone, "scale_in_dry_run").inc()
            return
        for _ in range(a.add):
            task = asyncio.create_task(self.actuator.start(zone))
            rt.starting.add(task)
            task.add_done_callback(functools.partial(self._started, zone, rt))
            m.ACTIONS.labels(zone, "scale_out").inc()
        for address in a.remove:
            await self._drain(rt, address, status[address].endpoint.id, now)
            m.ACTIONS.labels(zone, "drain").inc()
        for change in changes:
            if change.worker_id in rt.draining:
                continue
            await self._drain(rt, change.worker_id, status[change.worker_id].endpoint.id, now)
            rt.restart_as[change.worker_id] = change.to_role
            m.ACTIONS.labels(zone, "role_change").inc()

    async def _drain(self, rt: ZoneRuntime, address: str, worker_id: str, now: float) -> None:
        await rt.stub.DrainWorker(router_pb2.DrainWorkerRequest(worker_id=worker_id, drain=True), timeout=5.0)
        rt.draining[address] = (worker_id, now)

    def _started(self, zone: str, rt: ZoneRuntime, task: asyncio.Task[str]) -> None:
        rt.starting.discard(task)
        if task.cancelled() or task.exception() is not None:
            rt.changing.pop(task, None)
            m.ACTIONS.labels(zone, "start_failed").inc()
            log.error("zone %s: starting a worker failed: %s", zone, None if task.cancelled() else task.exception())
            return
        rt.announced.add(task.result())
        role = rt.changing.pop(task, None)
        if role is not None:
            rt.changing[task.result()] = role

    async def _finish_drains(
        self, zone: str, rt: ZoneRuntime, status: dict[str, router_pb2.WorkerStatus], now: float
    ) -> None:
        for address, (wid, since) in list(rt.draining.items()):
            w = status.get(address)
            idle = w is None or (w.in_flight == 0 and w.load.running == 0 and w.load.waiting == 0)
            if idle or now - since > self.drain_timeout_s:
                await self.actuator.stop(zone, address, wid)
                del rt.draining[address]
                rt.started_at.pop(address, None)
                role = rt.restart_as.pop(address, None)
                if role is None:
                    m.ACTIONS.labels(zone, "scale_in").inc()
                    continue
                task = asyncio.create_task(self.actuator.start(zone, role))  # its place, in the other role
                rt.starting.add(task)
                rt.changing[task] = role
                task.add_done_callback(functools.partial(self._started, zone, rt))

    async def close(self) -> None:
        for rt in self.zones.values():
            for t in list(rt.starting):
                t.cancel()
        await self.actuator.close()


def roles_of(workers: Sequence[router_pb2.WorkerStatus]) -> dict[str, WorkerRole]:
    """Each listed worker's prefill/decode role by address, from its endpoint's `worker_role` meta (the router
    lists what the registry or the worker says); a worker without one, or with a role this planner does not
    know, is left out (it counts as ``both``)."""
    out: dict[str, WorkerRole] = {}
    for w in workers:
        try:
            out[w.endpoint.address] = WorkerRole(w.endpoint.meta[WORKER_ROLE_META])
        except (KeyError, ValueError):
            continue
    return out
