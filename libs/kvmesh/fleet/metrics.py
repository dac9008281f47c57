"""Per-request records of a fleet run and the summary metrics of the fleet evaluation.

Definitions (all percentiles nearest-rank: the value at rank ⌈p/100 · n⌉ of the sorted sample):

* TTFT = first-token time − arrival; e2e = finish − arrival.
* ITL of a request = (e2e − TTFT) / (output_len − 1), its mean inter-token latency (0 for one token).
* hit_ratio = Σ cached prompt tokens at admission / Σ prompt tokens (what the engines reused).
* SLO per request: TTFT − allowance (``ttft_over_allowance``) ≤ ``Slo.ttft_s`` and ITL ≤ ``Slo.itl_s``;
  goodput = fraction of requests inside it (a rejected or unfinished request is outside). A run meets the
  SLO when none was rejected or left unfinished, p99(TTFT − allowance) ≤ ttft_s and p99(ITL) ≤ itl_s.
  ``Slo.ttft_mode``: "absolute" → allowance 0 (the literal SLO); "excess" → allowance = the request's own
  prefill time alone on an idle engine with an empty cache (perf model, chunked), i.e. the router may add at
  most ``ttft_s`` of queueing / cache-miss delay over what a cold, idle H200 needs for that prompt.
* ttft_excess of a request = TTFT − its TTFT alone on an idle engine with an infinite cache
  (``kvmesh.fleet.ideal``), ≥ 0: the queueing and the lost cache a policy caused. Reported as
  ``ttft_excess_ms.{p50,p90,p99}`` (:func:`ttft_excess_ms`); it is not the SLO's quantity.
* output_tokens_per_s = Σ output tokens / (last finish − first arrival).
* utilisation of worker w = compute utilisation: its dense-matmul work 2·P·(prefill + decode tokens) at the
  perf model's effective FLOP/s, divided by (last finish − first arrival) — the share of the GPU's usable
  compute the worker did (an engine decoding one sequence is "busy" but barely utilised).
  util_variance = population variance of those fractions across workers; util_cv = std / mean;
  busy_mean = mean fraction of time with a step running.
* cost_per_mtok = price_per_gpu_hour · workers · makespan_h / (Σ prompt + output tokens / 10⁶).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    """What the simulator measured for one request (times in virtual seconds)."""

    index: int
    worker: str
    arrival: float
    input_len: int
    output_len: int
    first_token: float = math.nan
    finish: float = math.nan
    cached_tokens: int = 0
    ttft_allow: float = 0.0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def ttft_over_allowance(self) -> float:
        """The TTFT the SLO judges: TTFT − ``ttft_allow``."""
        return self.ttft - self.ttft_allow

    @property
    def e2e(self) -> float:
        return self.finish - self.arrival

    @property
    def itl(self) -> float:
        return (self.finish - self.first_token) / (self.output_len - 1) if self.output_len > 1 else 0.0


@dataclass(frozen=True, slots=True)
class Slo:
    """Per-request service-level objective (seconds)."""

    ttft_s: float = 2.0
    itl_s: float = 0.1
    ttft_mode: str = "excess"


def pct(values: Sequence[float] | np.ndarray, p: float) -> float:
    """Nearest-rank percentile ``p`` in (0, 100]; NaN for an empty sample."""
    a = np.sort(np.asarray(values, dtype=float))
    if a.size == 0:
        return math.nan
    k = max(1, math.ceil(p / 100.0 * a.size))
    return float(a[k - 1])


def summarize(
    records: Sequence[RequestRecord],
    busy_s: dict[str, float],
    slo: Slo = Slo(),
    gpu_hour_price: float = 3.5,
    work_s: dict[str, float] | None = None,
) -> dict[str, object]:
    """The metric block of one run (see the module docstring); only finished requests are counted."""
    done = [r for r in records if not math.isnan(r.finish)]
    n = len(done)
    if n == 0:
        return {"requests": 0, "unfinished": len(records)}
    ttft = np.array([r.ttft for r in done])
    judged = np.array([r.ttft_over_allowance for r in done])
    e2e = np.array([r.e2e for r in done])
    itl = np.array([r.itl for r in done])
    t0 = min(r.arrival for r in done)
    span = max(max(r.finish for r in done) - t0, 1e-9)
    prompt = sum(r.input_len for r in done)
    out = sum(r.output_len for r in done)
    busy = np.array([b / span for b in busy_s.values()]) if busy_s else np.zeros(1)
    util = np.array([b / span for b in work_s.values()]) if work_s else busy
    ok = (judged <= slo.ttft_s) & (itl <= slo.itl_s)
    never = len(records) - n  # rejected or unfinished requests are outside the SLO
    workers = max(len(busy_s), 1)
    return {
        "requests": n,
        "unfinished": len(records) - n,
        "ttft_ms": {k: 1000 * pct(ttft, q) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "itl_ms": {k: 1000 * pct(itl, q) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "e2e_ms": {k: 1000 * pct(e2e, q) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "hit_ratio": sum(r.cached_tokens for r in done) / max(prompt, 1),
        "output_tokens_per_s": out / span,
        "ttft_over_allowance_ms_p99": 1000 * pct(judged, 99),
        "goodput": float(ok.sum()) / max(n + never, 1),
        "meets_slo": bool(never == 0 and pct(judged, 99) <= slo.ttft_s and pct(itl, 99) <= slo.itl_s),
        "util_mean": float(util.mean()),
        "util_variance": float(util.var()),
        "util_cv": float(util.std() / util.mean()) if util.mean() > 0 else 0.0,
        "busy_mean": float(busy.mean()),
        "cost_per_mtok": gpu_hour_price * workers * span / 3600.0 / ((prompt + out) / 1e6),
        "makespan_s": span,
    }


def ttft_excess_ms(records: Sequence[RequestRecord], ideal_ttft_s: Sequence[float] | np.ndarray) -> dict[str, float]:
    """p50/p90/p99 of TTFT − ideal TTFT (ms) over the requests that got a first token; ``ideal_ttft_s`` is
    indexed by ``RequestRecord.index``. Clipped at 0: the ideal is a lower bound, so only float rounding
    (< 1 ns) falls below it."""
    ideal = np.asarray(ideal_ttft_s, dtype=float)
    got = [r for r in records if not math.isnan(r.first_token)]
    ex = np.maximum(np.array([r.ttft for r in got]) - ideal[[r.index for r in got]], 0.0) if got else np.zeros(0)
    return {k: 1000 * pct(ex, q) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))}
