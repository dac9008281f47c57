"""Per-request records of a fleet run and the summary metrics of issue 6.

Definitions (all percentiles nearest-rank: the value at rank ⌈p/100 · n⌉ of the sorted sample):

* TTFT = first-token time − arrival; e2e = finish − arrival.
* ITL of a request = (e2e − TTFT) / (output_len − 1), its mean inter-token latency (0 for one token).
* hit_ratio = Σ cached prompt tokens at admission / Σ prompt tokens (what the engines reused).
* SLO per request: TTFT ≤ ``ttft_slo_s`` and ITL ≤ ``itl_slo_s``; goodput = fraction of requests inside it.
  A run meets the SLO when TTFT p99 ≤ ``ttft_slo_s`` and ITL p99 ≤ ``itl_slo_s`` (over all requests).
* output_tokens_per_s = Σ output tokens / (last finish − first arrival).
* utilisation of worker w = busy time (Σ engine step durations) / (last finish − first arrival);
  util_variance = population variance of those fractions across workers; util_cv = std / mean.
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

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

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
) -> dict[str, object]:
    """The metric block of one run (see the module docstring); only finished requests are counted."""
    done = [r for r in records if not math.isnan(r.finish)]
    n = len(done)
    if n == 0:
        return {"requests": 0, "unfinished": len(records)}
    ttft = np.array([r.ttft for r in done])
    e2e = np.array([r.e2e for r in done])
    itl = np.array([r.itl for r in done])
    t0 = min(r.arrival for r in done)
    span = max(max(r.finish for r in done) - t0, 1e-9)
    prompt = sum(r.input_len for r in done)
    out = sum(r.output_len for r in done)
    util = np.array([b / span for b in busy_s.values()]) if busy_s else np.zeros(1)
    ok = (ttft <= slo.ttft_s) & (itl <= slo.itl_s)
    workers = max(len(busy_s), 1)
    return {
        "requests": n,
        "unfinished": len(records) - n,
        "ttft_ms": {k: 1000 * pct(ttft, q) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "itl_ms": {k: 1000 * pct(itl, q) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "e2e_ms": {k: 1000 * pct(e2e, q) for k, q in (("p50", 50), ("p90", 90), ("p99", 99))},
        "hit_ratio": sum(r.cached_tokens for r in done) / max(prompt, 1),
        "output_tokens_per_s": out / span,
        "goodput": float(ok.mean()),
        "meets_slo": bool(pct(ttft, 99) <= slo.ttft_s and pct(itl, 99) <= slo.itl_s),
        "util_mean": float(util.mean()),
        "util_variance": float(util.var()),
        "util_cv": float(util.std() / util.mean()) if util.mean() > 0 else 0.0,
        "cost_per_mtok": gpu_hour_price * workers * span / 3600.0 / ((prompt + out) / 1e6),
        "makespan_s": span,
    }
