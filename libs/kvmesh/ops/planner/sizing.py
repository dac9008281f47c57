"""From a load forecast to a worker count, and from a worker count to scaling steps (pure).

Desired workers (seed 000 §4.3, seed 003 §1.3):

    desired = clamp(ceil(peak_forecast_rps · (1 + buffer) / per_worker_rps), min_workers, max_workers)

with ``peak_forecast_rps`` the highest forecast rate over the next ``lead_s`` (20 min), ``buffer`` 0.2
(bursts) and ``min_workers`` 2 (warm instances at all times). The planner forecasts the whole hour but sizes
for its first ``lead_s`` only: that is what it cannot catch up with once it sees it coming (a start takes
5 min, a step comes every minute, the forecast moves in 5-min buckets); a rise later in the hour is seen at
a later step, still in time, and sizing for it now only bills workers early.

:func:`plan_step` turns it into an action: scale out at once (also by one when more than
``queue_scale_out`` requests wait, the seed's alert threshold); scale in only after the desired count has
stayed below the current one for ``scale_in_delay_s``, by at most ``scale_in_step`` workers per
``scale_in_cooldown_s``, and only workers that have lived ``min_lifetime_s`` (30 min), oldest-started last so
that the warmest caches stay. Scale-in is therefore slower than scale-out.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SizingPolicy:
    """The planner's capacity model and scaling rules."""

    per_worker_rps: float
    buffer: float = 0.2
    lead_s: float = 1200.0
    min_workers: int = 2
    max_workers: int = 64
    min_lifetime_s: float = 1800.0
    scale_in_delay_s: float = 900.0
    scale_in_cooldown_s: float = 600.0
    scale_in_step: int = 1
    queue_scale_out: int = 50

    def __post_init__(self) -> None:
        if self.per_worker_rps <= 0:
            raise ValueError("per_worker_rps must be > 0")
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError("need 1 <= min_workers <= max_workers")
        if self.buffer < 0 or self.scale_in_step < 1:
            raise ValueError("buffer must be >= 0 and scale_in_step >= 1")
        if not self.lead_s > 0:
            raise ValueError("lead_s must be > 0")

    def sized_rate(self, forecast: np.ndarray | Sequence[float], bucket_s: float) -> float:
        """The rate (requests/s) the fleet is sized for: the highest of the forecast buckets (arrivals per
        ``bucket_s``) that start within ``lead_s``; 0 for an empty forecast."""
        n = max(math.ceil(self.lead_s / bucket_s - 1e-9), 1)
        return max((float(x) for x in forecast[:n]), default=0.0) / bucket_s

    def desired(self, peak_forecast_rps: float) -> int:
        """Workers for a forecast peak rate (requests/s), buffer included, within [min, max]."""
        need = math.ceil(max(peak_forecast_rps, 0.0) * (1.0 + self.buffer) / self.per_worker_rps - 1e-9)
        return min(max(need, self.min_workers), self.max_workers)


@dataclass(frozen=True)
class WorkerLife:
    """A worker the planner may scale in: its id and when it started serving."""

    worker_id: str
    started_s: float


@dataclass
class ScalerState:
    """What :func:`plan_step` remembers between calls (restored from the planner's checkpoint)."""

    below_since_s: float | None = None
    last_scale_in_s: float = -math.inf


@dataclass(frozen=True)
class ScaleAction:
    """Start ``add`` workers and drain ``remove``; ``reason`` says why (events and logs)."""

    add: int = 0
    remove: tuple[str, ...] = ()
    reason: str = ""


def plan_step(
    policy: SizingPolicy,
    state: ScalerState,
    now_s: float,
    desired: int,
    serving: Sequence[WorkerLife],
    starting: int,
    queued: int,
    removable: Collection[str] | None = None,
) -> ScaleAction:
    """One planner decision; updates ``state``. ``serving`` are workers taking traffic, ``starting`` ones
    not yet ready (they count toward the target, so a slow start is not answered by more starts);
    ``removable`` the ids an actuator can stop (None: all)."""
    have = len(serving) + starting
    if queued > policy.queue_scale_out and have < policy.max_workers:
        state.below_since_s = None
        return ScaleAction(add=max(desired - have, 1), reason=f"queue {queued} > {policy.queue_scale_out}")
    if desired > have:
        state.below_since_s = None
        return ScaleAction(add=desired - have, reason=f"forecast needs {desired}, have {have}")
    if desired >= have:
        state.below_since_s = None
        return ScaleAction()
    if state.below_since_s is None:
        state.below_since_s = now_s
    if now_s - state.below_since_s < policy.scale_in_delay_s:
        return ScaleAction(reason="scale-in delay")
    if now_s - state.last_scale_in_s < policy.scale_in_cooldown_s or starting:
        return ScaleAction(reason="scale-in cooldown")
    floor = max(desired, policy.min_workers)
    old_enough = [
        w
        for w in serving
        if now_s - w.started_s >= policy.min_lifetime_s and (removable is None or w.worker_id in removable)
    ]
    old_enough.sort(key=lambda w: (-w.started_s, w.worker_id))  # youngest first: the oldest caches stay
    n = min(policy.scale_in_step, len(serving) - floor, len(old_enough))
    if n <= 0:
        return ScaleAction(reason="minimum lifetime")
    state.last_scale_in_s = now_s
    return ScaleAction(
        remove=tuple(w.worker_id for w in old_enough[:n]), reason=f"forecast needs {desired}, have {have}"
    )
