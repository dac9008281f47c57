"""SLO capacity: the highest arrival-rate scale at which a policy keeps the SLO, by bisection.

``meets(s)`` runs the trace with timestamps divided by ``s`` and says whether p99 of the TTFT excess and of
the ITL are inside the SLO. Assuming ``meets`` is monotone (more load never helps):

1. bracket: from ``start``, double while it passes / halve while it fails, until a passing ``lo`` and a
   failing ``hi`` (``lo`` = 0 if it still fails at ``min_scale``; ``hi`` = ∞ if it passes at ``max_scale``);
2. bisect geometrically, ``m = √(lo·hi)``, until ``hi / lo ≤ 1 + rel_tol`` or ``max_iter`` runs.

The answer is ``lo`` (the highest scale *observed* to pass). Every probe is recorded.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(slots=True)
class Capacity:
    """Result of a bisection: ``value`` passes, ``upper`` fails (``inf`` if never failed)."""

    value: float
    upper: float
    probes: list[tuple[float, bool]] = field(default_factory=list)


def bisect_capacity(
    meets: Callable[[float], bool],
    start: float = 1.0,
    rel_tol: float = 0.05,
    min_scale: float = 1 / 64,
    max_scale: float = 64.0,
    max_iter: int = 16,
) -> Capacity:
    """See the module docstring. ``max_iter`` bounds the total number of ``meets`` calls."""
    probes: list[tuple[float, bool]] = []

    def probe(s: float) -> bool:
        ok = meets(s)
        probes.append((s, ok))
        return ok

    lo, hi = 0.0, math.inf
    s = start
    while len(probes) < max_iter:
        if probe(s):
            lo = s
            if s >= max_scale or hi < math.inf:
                break
            s = min(s * 2.0, max_scale)
        else:
            hi = s
            if s <= min_scale or lo > 0.0:
                break
            s = max(s / 2.0, min_scale)
    while lo > 0.0 and hi < math.inf and hi / lo > 1.0 + rel_tol and len(probes) < max_iter:
        m = math.sqrt(lo * hi)
        if probe(m):
            lo = m
        else:
            hi = m
    return Capacity(lo, hi, probes)
