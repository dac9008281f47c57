"""The planner in the fleet simulator: workers join (after a start-up time, cold) and leave (drained).

Every ``tick_s`` of simulated time the autoscaler does what ``kvmesh-planner`` does on a live fleet: it
counts the arrivals of every bucket that has ended (it never sees the future), forecasts the next hour
from them (after ``history``, the days before the simulated one), sizes the fleet
(:class:`kvmesh.planner.sizing.SizingPolicy`) and applies :func:`kvmesh.planner.sizing.plan_step`. A
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
from kvmesh.planner.forecast import Forecaster
from kvmesh.planner.sizing import ScalerState, SizingPolicy, WorkerLife, plan_step


@dataclass(frozen=True)
class AutoscaleSettings:
    """How the simulated planner runs."""

    sizing: SizingPolicy
    initial_workers: int
    tick_s: float = 60.0
    bucket_s: float = 300.0
    horizon_buckets: int = 12
    startup_s: float = 300.0


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

    def _observed(self, now: float) -> np.ndarray:
        b = self.settings.bucket_s
        done = int(now // b)
        counts = np.bincount((self.arrivals_s[self.arrivals_s < done * b] // b).astype(int), minlength=done)
        return np.concatenate([self.history, counts[:done].astype(float)])

    def _tick(self, sim: FleetSim) -> None:
        s, now = self.settings, sim.now
        self._stop_drained(sim)
        series = self._observed(now)
        pred = self.forecaster.predict(series, 0, s.horizon_buckets) if series.size else np.zeros(1)
        desired = s.sizing.desired(float(np.max(pred)) / s.bucket_s)
        serving = [WorkerLife(sim.ids[v], self._started[v]) for v in self._started if v not in self._draining]
        queued = sum(w.waiting for w in sim.views())
        action = plan_step(s.sizing, self._state, now, desired, serving, len(self._booting), queued)
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
        counts = [t[1] + t[2] for t in self.timeline]
        return {
            "gpu_hours": self.billed_s / 3600.0,
            "min_workers": min((t[1] for t in self.timeline), default=0),
            "max_workers": max(counts, default=0),
        }
