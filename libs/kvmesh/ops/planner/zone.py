"""One zone's planning step: history → forecast → desired workers → a scaling action (pure).

The forecaster it trusts is the best of :func:`kvmesh.ops.planner.forecast.compare` on the last day of history,
refitted every ``retrain_s`` once ``min_train_days`` + 1 days are recorded; before that, the moving average
over the last ``average_window_s`` (an hour; no model can be judged without a held-out day, so the planner
says ``moving_average``).

A disaggregated zone (``PlannerConfig.pools``) is sized pool by pool (:mod:`kvmesh.ops.planner.pools`): its
desired workers are the prefill and decode targets' sum, and each step also says which workers change role.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvmesh.core.handoff import WorkerRole
from kvmesh.ops.planner.forecast import Comparison, Forecaster, LstmForecaster, MovingAverage, compare, forecaster_named
from kvmesh.ops.planner.history import DAY_S, LoadHistory
from kvmesh.ops.planner.pools import PooledWorker, PoolPlan, PoolPolicy, SplitState, plan_split, pool_targets
from kvmesh.ops.planner.sizing import ScaleAction, ScalerState, SizingPolicy, WorkerLife, plan_step


@dataclass(frozen=True)
class PlannerConfig:
    """How a zone is planned."""

    sizing: SizingPolicy
    bucket_s: float = 300.0
    horizon_buckets: int = 12
    retrain_s: float = 6 * 3600.0
    min_train_days: int = 2
    lstm_epochs: int = 150
    average_window_s: float = 3600.0
    pools: PoolPolicy | None = None  # a disaggregated zone: prefill and decode pools sized apart


@dataclass(frozen=True)
class Decision:
    """What one step decided, for actuators, metrics and logs."""

    action: ScaleAction
    desired: int
    forecast_rps: float
    forecaster: str
    forecast: tuple[float, ...] = ()  # requests per bucket, the next `horizon_buckets` buckets
    pools: PoolPlan | None = None  # a disaggregated zone's pool sizing and role changes


@dataclass
class ZonePlanner:
    """The planner's state for one zone (history, scaler state and the trusted forecaster)."""

    config: PlannerConfig
    history: LoadHistory
    state: ScalerState = field(default_factory=ScalerState)
    split: SplitState = field(default_factory=SplitState)
    comparison: Comparison | None = None
    last_train_s: float = -math.inf
    _forecaster: Forecaster | None = None

    @classmethod
    def create(cls, config: PlannerConfig) -> ZonePlanner:
        return cls(config, LoadHistory(bucket_s=config.bucket_s))

    @property
    def buckets_per_day(self) -> int:
        return max(int(DAY_S // self.config.bucket_s), 1)

    @property
    def hour_buckets(self) -> int:
        return max(int(3600 // self.config.bucket_s), 1)

    def forecaster(self) -> Forecaster:
        window = max(int(self.config.average_window_s // self.config.bucket_s), 1)
        return self._forecaster or MovingAverage(window)

    def maybe_retrain(self, now_s: float) -> bool:
        """Refits and re-judges the forecasters when due and a held-out day exists; True if it did."""
        series = self.history.completed(now_s)
        day = self.buckets_per_day
        if series.size < (self.config.min_train_days + 1) * day or now_s - self.last_train_s < self.config.retrain_s:
            return False
        lstm = LstmForecaster(period=day, horizon=self.config.horizon_buckets, epochs=self.config.lstm_epochs)
        self.comparison = compare(series, series.size - day, day, self.hour_buckets, lstm)
        if self.comparison.chosen == "lstm":
            lstm.fit(series, self.history.start_bucket)  # refit on everything, the held-out day included
        self._forecaster = forecaster_named(self.comparison.chosen, day, self.hour_buckets, lstm)
        self.last_train_s = now_s
        return True

    def step(
        self,
        now_s: float,
        serving: Sequence[WorkerLife],
        starting: int,
        queued: int,
        removable: Collection[str] | None = None,
        roles: Mapping[str, WorkerRole] | None = None,
        incoming: Mapping[WorkerRole, int] | None = None,
    ) -> Decision:
        """Forecast the next ``horizon`` buckets, size the zone for the first ``lead_s`` of them, decide (see
        :func:`plan_step`); a disaggregated zone's pools too, `roles` giving each serving worker's (by
        ``worker_id``; one not in it is ``both``), `incoming` the workers a role change is moving into each
        pool (not serving meanwhile: counted where they are going, so the change is not asked twice)."""
        series = self.history.completed(now_s)
        f = self.forecaster()
        pred = f.predict(series, self.history.start_bucket, self.config.horizon_buckets) if series.size else np.zeros(0)
        sizing = self.config.sizing
        rps = sizing.sized_rate(pred, self.config.bucket_s)
        if self.config.pools is None:
            desired = sizing.desired(rps)
            action = plan_step(sizing, self.state, now_s, desired, serving, starting, queued, removable)
            return Decision(action, desired, rps, f.name, tuple(float(x) for x in pred))
        targets = pool_targets(self.config.pools, rps, sizing.min_workers, sizing.max_workers)
        action = plan_step(sizing, self.state, now_s, targets.total, serving, starting, queued, removable)
        staying = [w for w in serving if w.worker_id not in action.remove]  # a worker scaled in changes no role
        pooled = [PooledWorker(w, (roles or {}).get(w.worker_id, WorkerRole.BOTH)) for w in staying]
        pools = plan_split(self.config.pools, self.split, now_s, targets, pooled, incoming or {})
        return Decision(action, targets.total, rps, f.name, tuple(float(x) for x in pred), pools)
