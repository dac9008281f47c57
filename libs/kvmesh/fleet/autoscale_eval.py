"""Autoscaled against fixed: one simulated day of a one-hour trace, the planner's forecast checked first.

Protocol (``python -m kvmesh.bench autoscale``):

1. **Capacity model.** The source hour's first 900 s on ``measure_workers`` workers, capacity bisection as in
   ``kvmesh.bench fleet`` (same SLO): ``per_worker_rps`` = capacity scale × the window's rate / workers.
2. **Days.** ``history_days`` + 1 days from the hour (:mod:`kvmesh.fleet.diurnal`), thinned so that the day's
   peak hour needs about ``peak_workers`` workers: base keep = 0.9 · peak_workers · per_worker_rps / the
   hour's own rate (above 1, whole copies of the hour are overlaid).
3. **Forecast.** Arrivals per 5 min; the LSTM is trained on the history days, it and the baselines are
   scored on the last day (held out), and the planner uses the one with the lowest error there.
4. **Fleets.** The last day is simulated twice with the kvmesh policy: a fixed fleet sized for the day's
   peak hour (⌈peak rate / per_worker_rps⌉ workers, billed all day) and the autoscaled one (the planner,
   :mod:`kvmesh.fleet.autoscale`). Both are judged by the bench's SLO; cost = GPU-hours × price × load
   factor, with load factor 1 (an instance is billed for every hour it is up, whatever its load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmesh.fleet.autoscale import Autoscaler, AutoscaleSettings
from kvmesh.fleet.capacity import bisect_capacity
from kvmesh.fleet.diurnal import HOUR_S, DayShape, arrival_counts, repeat_hour
from kvmesh.fleet.ideal import servable_trace
from kvmesh.fleet.policies import make_policy
from kvmesh.fleet.sim import FleetConfig, FleetSim, HashCache, RunResult
from kvmesh.fleet.trace import Trace
from kvmesh.planner.forecast import LstmForecaster, compare, forecaster_named
from kvmesh.planner.sizing import SizingPolicy

DAY_BUCKETS = 288  # 5-minute buckets


@dataclass(frozen=True)
class AutoscaleStudy:
    """The knobs of one evaluation (defaults: the bench's)."""

    peak_workers: int = 4
    measure_workers: int = 4
    history_days: int = 3
    shape: DayShape = DayShape()
    seed: int = 0
    gpu_hour_price: float = 3.5
    startup_s: float = 300.0
    buffer: float = 0.2
    min_workers: int = 2
    lstm_epochs: int = 150


def measure_per_worker_rps(hour: Trace, workers: int, seed: int) -> tuple[float, float]:
    """(requests/s one worker sustains within the SLO, the capacity scale) on the hour's first 900 s."""
    win = hour.window(0.0, 900.0)
    hc = HashCache(win, FleetConfig().block_size)

    def meets(scale: float) -> bool:
        cfg = FleetConfig(workers=workers, seed=seed, load_scale=scale, stop_when_slo_lost=True)
        res = FleetSim(win, make_policy("kvmesh"), cfg, hc).run()
        return bool(res.summary.get("meets_slo")) and not res.truncated

    cap = bisect_capacity(meets, start=0.5, rel_tol=0.05, max_iter=10)
    return cap.value * len(win) / 900.0 / workers, cap.value


def _run(day: Trace, workers: int, study: AutoscaleStudy, scaler: Autoscaler | None) -> tuple[RunResult, float]:
    cfg = FleetConfig(workers=workers, seed=study.seed, gpu_hour_price=study.gpu_hour_price)
    sim = FleetSim(day, make_policy("kvmesh"), cfg, HashCache(day, cfg.block_size))
    if scaler is not None:
        scaler.attach(sim)
    res = sim.run()
    if scaler is None:
        return res, workers * sim.now / 3600.0
    scaler.finish(sim.now)
    return res, scaler.billed_s / 3600.0


def _arm(res: RunResult, gpu_hours: float, study: AutoscaleStudy) -> dict[str, Any]:
    s = res.summary
    return {
        "gpu_hours": round(gpu_hours, 3),
        "slo_met": bool(s.get("meets_slo")),
        "ttft_p99_ms": round(float(s["ttft_ms"]["p99"]), 1),  # type: ignore[index]
        "cost_usd": round(gpu_hours * study.gpu_hour_price, 2),
        "goodput": round(float(s["goodput"]), 4),  # type: ignore[arg-type]
        "requests": int(s["requests"]),  # type: ignore[call-overload]
    }


def evaluate(source: Trace, study: AutoscaleStudy) -> dict[str, Any]:
    """The bench's JSON line (module docstring) plus the series the report plots (``series``)."""
    hour, gone = servable_trace(source.window(0.0, HOUR_S), FleetConfig().engine_config())
    pwr, cap = measure_per_worker_rps(hour, study.measure_workers, study.seed)
    base = 0.9 * study.peak_workers * pwr / (len(hour) / HOUR_S)
    days = study.history_days + 1
    keep = (base * study.shape.multipliers(days, study.seed)).ravel().tolist()
    series = np.concatenate(
        [arrival_counts(repeat_hour(hour, keep[d * 24 : (d + 1) * 24], study.seed + d), 300.0, DAY_BUCKETS)
         for d in range(days)]
    )  # fmt: skip
    day = repeat_hour(hour, keep[-24:], study.seed + days - 1)  # the held-out day, as counted above
    test_from = study.history_days * DAY_BUCKETS
    lstm = LstmForecaster(period=DAY_BUCKETS, epochs=study.lstm_epochs, seed=study.seed)
    cmp = compare(series, test_from, DAY_BUCKETS, 12, lstm)
    peak_rps = float(max(arrival_counts(day, HOUR_S, 24))) / HOUR_S
    fixed_n = max(math.ceil(peak_rps / pwr), study.min_workers)
    sizing = SizingPolicy(
        per_worker_rps=pwr, buffer=study.buffer, min_workers=study.min_workers, max_workers=2 * fixed_n
    )
    forecaster = forecaster_named(cmp.chosen, DAY_BUCKETS, 12, lstm)
    first = sizing.desired(float(np.max(forecaster.predict(series[:test_from], 0, 12))) / 300.0)
    scaler = Autoscaler(
        AutoscaleSettings(sizing=sizing, initial_workers=first, startup_s=study.startup_s),
        forecaster,
        history=series[:test_from],
        arrivals_s=np.sort(np.array([r.arrival_s for r in day.requests])),
    )
    fixed_res, fixed_h = _run(day, fixed_n, study, None)
    auto_res, auto_h = _run(day, sizing.max_workers, study, scaler)
    auto = {**_arm(auto_res, auto_h, study), **{k: v for k, v in scaler.summary().items() if k != "gpu_hours"}}
    return {
        "trace": source.name,
        "fixed": {**_arm(fixed_res, fixed_h, study), "workers": fixed_n},
        "autoscaled": auto,
        "gpu_hours_saved": round(1 - auto_h / fixed_h, 4) if fixed_h else 0.0,
        "forecast": cmp.to_json(),
        "capacity_model": {"per_worker_rps": round(pwr, 4), "capacity_scale": round(cap, 4), "base_keep": base},
        "unservable": len(gone.indices),
        "series": {
            "arrivals_5min": series[test_from:].tolist(),
            "timeline": scaler.timeline,
        },
    }
