"""The planner in the fleet simulator: workers join (after a start-up time, cold) and leave (drained).

Every ``tick_s`` of simulated time the autoscaler does what ``kvmesh-planner`` does on a live fleet: it
counts the arrivals of every bucket that has ended (it never sees the future), forecasts the next hour
from them (after ``history``, the days before the simulated one), sizes the fleet
(:class:`kvmesh.ops.planner.sizing.SizingPolicy`) and applies :func:`kvmesh.ops.planner.sizing.plan_step`. A
started worker is billed from its start and routable after ``startup_s``, with an empty cache; a worker
scaled in takes no new request, finishes what it holds, then stops (billing ends, its cache is gone).
GPU-hours are the billed worker-seconds / 3600.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvmesh.fleet.sim import FleetSim
from kvmesh.ops.planner.forecast import Forecaster
from kvmesh.ops.planner.sizing import ScaleAction, ScalerState, SizingPolicy, WorkerLife, plan_step


@dataclass(frozen=True)
class AutoscaleSettings:
    """How the simulated planner runs."""

    sizing: SizingPolicy
    initial_workers: int
    tick_s: float = 60.0
    bucket_s: float = 300.0
    horizon_buckets: int = 12
    startup_s: float = 300.0


def observed(history: np.ndarray, arrivals_s: np.ndarray, now: float, bucket_s: float) -> np.ndarray:
    """``history`` and the arrival counts of every bucket of ``arrivals_s`` that has ended by ``now``."""
    done = int(now // bucket_s)
    counts = np.bincount((arrivals_s[arrivals_s < done * bucket_s] // bucket_s).astype(int), minlength=done)
    return np.concatenate([history, counts[:done].astype(float)])


def decide(
    settings: AutoscaleSettings,
    forecaster: Forecaster,
    state: ScalerState,
    now: float,
    series: np.ndarray,
    serving: list[WorkerLife],
    starting: int,
    queued: int,
) -> tuple[int, ScaleAction]:
    """One planner step, as ``kvmesh-planner`` takes it: forecast, size, :func:`plan_step`."""
    pred = forecaster.predict(series, 0, settings.horizon_buckets) if series.size else np.zeros(0)
    desired = settings.sizing.desired(settings.sizing.sized_rate(pred, settings.bucket_s))
    return desired, plan_step(settings.sizing, state, now, desired, serving, starting, queued)


@dataclass
class Autoscaler:
    """Drives one :class:`FleetSim` run; ``timeline`` records (time, serving, starting, desired)."""

    settings: AutoscaleSettings
    forecaster: Forecaster
    history: np.ndarray
    arrivals_s: np.ndarray  # the simulated trace's arrival times (sim time), sorted
    timeline: list[tuple[float, int, int, int]] = field(default_factory=list)
    billed_s: float = 0.0
    _on_since: dict[int, float] = field(default_factory=dict)
    _started: dict[int, float] = field(default_factory=dict)  # slot → when it began serving
    _booting: set[int] = field(default_factory=set)
    _draining: set[int] = field(default_factory=set)
    _state: ScalerState = field(default_factory=ScalerState)

    def attach(self, sim: FleetSim) -> None:
        """Before ``sim.run()``: the first ``initial_workers`` slots serve, the rest are off."""
        n = self.settings.initial_workers
        if not 1 <= n <= len(sim.ids):
            raise ValueError(f"initial_workers {n} not in [1, {len(sim.ids)}]")
        for slot in range(len(sim.ids)):
            sim.serving[slot] = slot < n
            if slot < n:
                self._on_since[slot] = 0.0
                self._started[slot] = -math.inf  # warm from the start: old enough to scale in
        sim.at(0.0, lambda: self._tick(sim))

    def _tick(self, sim: FleetSim) -> None:
        s, now = self.settings, sim.now
        self._stop_drained(sim)
        series = observed(self.history, self.arrivals_s, now, s.bucket_s)
        serving = [WorkerLife(sim.ids[v], self._started[v]) for v in self._started if v not in self._draining]
        queued = sum(w.waiting for w in sim.views())
        desired, action = decide(s, self.forecaster, self._state, now, series, serving, len(self._booting), queued)
        for _ in range(action.add):
            self._start(sim)
        for wid in action.remove:
            slot = sim.slot[wid]
            sim.serving[slot] = False
            self._draining.add(slot)
            del self._started[slot]
        self.timeline.append((now, len(serving) - len(action.remove), len(self._booting), desired))
        if sim.pending_events():
            sim.at(now + s.tick_s, lambda: self._tick(sim))
        else:
            self.finish(now)

    def _start(self, sim: FleetSim) -> None:
        off = [v for v in range(len(sim.ids)) if v not in self._on_since]
        if not off:
            return
        slot = off[0]
        self._on_since[slot] = sim.now
        self._booting.add(slot)

        def ready() -> None:
            self._booting.discard(slot)
            self._started[slot] = sim.now
            sim.serving[slot] = True

        sim.at(sim.now + self.settings.startup_s, ready)

    def _stop_drained(self, sim: FleetSim) -> None:
        for slot in sorted(self._draining):
            if sim.idle(slot):
                sim.reset_worker(slot)
                self._draining.discard(slot)
                self.billed_s += sim.now - self._on_since.pop(slot)

    def finish(self, end_s: float) -> None:
        """Bills every worker still on until ``end_s`` (the end of the run)."""
        for slot, since in list(self._on_since.items()):
            self.billed_s += max(end_s - since, 0.0)
            del self._on_since[slot]

    def summary(self) -> dict[str, Any]:
        return {"gpu_hours": self.billed_s / 3600.0, **worker_range(self.timeline)}


def worker_range(timeline: list[tuple[float, int, int, int]]) -> dict[str, int]:
    """Fewest workers serving and most workers on (serving + starting) over a timeline."""
    return {
        "min_workers": min((t[1] for t in timeline), default=0),
        "max_workers": max((t[1] + t[2] for t in timeline), default=0),
    }


@dataclass(frozen=True)
class PlannedDay:
    """The planner's decisions over a day without a simulated fleet (:func:`plan_open_loop`)."""

    timeline: list[tuple[float, int, int, int]]  # (time, serving, starting, desired), as Autoscaler's
    billed_s: float

    def serving_at(self, t: float) -> int:
        """Workers serving at the last step at or before ``t``."""
        return next((n for at, n, _, _ in reversed(self.timeline) if at <= t), self.timeline[0][1])


def plan_open_loop(
    settings: AutoscaleSettings, forecaster: Forecaster, history: np.ndarray, arrivals_s: np.ndarray, end_s: float
) -> PlannedDay:
    """The planner's steps over ``[0, end_s)`` on arrivals alone: no queue ever builds (the queue rule never
    fires) and a drained worker stops at once. Far cheaper than a simulated day; its GPU-hours differ from the
    closed loop's by the drains and the queue rule (the bench reports both where it runs both); the SLO is not
    judged here."""
    state = ScalerState()
    on_since = {f"w{i}": 0.0 for i in range(settings.initial_workers)}
    started = dict.fromkeys(on_since, -math.inf)  # warm from the start, as in Autoscaler.attach
    ready_at: dict[str, float] = {}
    timeline: list[tuple[float, int, int, int]] = []
    billed = 0.0
    t = 0.0
    while t < end_s:
        for wid in [w for w, r in ready_at.items() if r <= t]:
            started[wid] = ready_at.pop(wid)
        serving = [WorkerLife(w, at) for w, at in started.items()]
        series = observed(history, arrivals_s, t, settings.bucket_s)
        desired, action = decide(settings, forecaster, state, t, series, serving, len(ready_at), 0)
        for _ in range(min(action.add, settings.sizing.max_workers - len(on_since))):
            wid = f"w{len(timeline)}-{len(on_since)}"
            on_since[wid], ready_at[wid] = t, t + settings.startup_s
        for wid in action.remove:
            del started[wid]
            billed += t - on_since.pop(wid)
        timeline.append((t, len(serving) - len(action.remove), len(ready_at), desired))
        t += settings.tick_s
    billed += sum(end_s - since for since in on_since.values())
    return PlannedDay(timeline, billed)
