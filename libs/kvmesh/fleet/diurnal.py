"""A day (or several) of traffic from a one-hour trace: the hour repeated, its rate varied by the hour.

The public traces kvmesh is evaluated on each cover one hour (Mooncake conversation: 12,031 requests in
3,537 s; Azure conversation: 19,366 in 3,502 s), so neither has a daily shape of its own. Day d, hour h is
a copy of the source hour in which every request is kept with probability

    p(d, h) = base · shape(h) · noise(d, h),   shape(h) = trough + (1 − trough) · (1 + cos(2π(h − peak_h)/24)) / 2

(a raised cosine: 1 at ``peak_h``, ``trough`` twelve hours away; noise log-normal with σ ``noise_sigma``,
independent per day and hour, so yesterday is a good but imperfect guide to today); a p above 1 overlays
whole copies of the hour. Each copy gets its own chunk-id namespace: reuse happens within an hour as in the
source, never across copies.
Deterministic for a seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvmesh.fleet.trace import Trace, TraceRequest

HOUR_S = 3600.0
_COPY_SHIFT = 33  # chunk ids of the traces are < 2^32; copy k uses [k·2^33, (k+1)·2^33)


@dataclass(frozen=True)
class DayShape:
    """The hourly rate multipliers (see the module docstring)."""

    trough: float = 0.25
    peak_hour: float = 14.0
    noise_sigma: float = 0.1

    def shape(self, hour: int) -> float:
        return self.trough + (1 - self.trough) * (1 + math.cos(2 * math.pi * (hour - self.peak_hour) / 24)) / 2

    def multipliers(self, days: int, seed: int) -> np.ndarray:
        """``days × 24`` keep multipliers before ``base`` (shape × noise)."""
        rng = np.random.default_rng(seed)
        noise = np.exp(rng.normal(0.0, self.noise_sigma, size=(days, 24)) - self.noise_sigma**2 / 2)
        return np.array([[self.shape(h) for h in range(24)]] * days) * noise


def repeat_hour(hour: Trace, keep: Sequence[float], seed: int) -> Trace:
    """``len(keep)`` consecutive copies of ``hour`` (its first 3,600 s), copy k at rate ``keep[k]``: each
    request kept with probability ``keep[k]``, or, above 1, ⌊keep⌋ whole overlaid copies plus one thinned
    to the fraction left (each overlay its own chunk namespace, so overlays share nothing)."""
    src = [r for r in hour.requests if r.follows is None and r.arrival_s < HOUR_S]
    if not src:
        raise ValueError(f"trace {hour.name} has no open-loop request in its first hour")
    rng = np.random.default_rng(seed)
    out: list[TraceRequest] = []
    namespace = 0
    for k, p in enumerate(keep):
        if not p >= 0.0:
            raise ValueError(f"keep[{k}] = {p} is not >= 0")
        layer: list[tuple[float, int, int, TraceRequest]] = []
        for frac in [1.0] * int(p) + [p - int(p)]:
            namespace += 1
            draws = rng.random(len(src))
            offset = namespace << _COPY_SHIFT
            layer += [
                (r.arrival_s + k * HOUR_S, offset, namespace, r) for r, u in zip(src, draws, strict=True) if u < frac
            ]
        layer.sort(key=lambda x: x[0])
        # built in one pass (no dataclasses.replace: a day is about a million requests)
        out += [
            TraceRequest(
                len(out) + i,
                arrival,
                r.input_len,
                r.output_len,
                tuple(c + offset for c in r.chunks),
                f"{r.session}@{ns}" if r.session else None,
                r.tenant,
                r.follows,
                r.think_s,
            )
            for i, (arrival, offset, ns, r) in enumerate(layer)
        ]
    return Trace(f"{hour.name}x{len(keep)}h", out, {**hour.meta, "hours": len(keep)})


def arrival_counts(trace: Trace, bucket_s: float, buckets: int) -> np.ndarray:
    """Open-loop arrivals per ``bucket_s`` bucket, ``buckets`` of them from time 0."""
    t = np.array([r.arrival_s for r in trace.requests if r.follows is None])
    counts, _ = np.histogram(t, bins=buckets, range=(0.0, buckets * bucket_s))
    return counts.astype(float)
