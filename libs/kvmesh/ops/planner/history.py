"""A zone's request history in fixed buckets, built from the routers' per-worker request counters (pure).

The planner reads ``selections_total`` of every worker a router lists (requests routed to it since the
router started). ``observe(now, totals)`` adds to the bucket holding ``now`` the sum over workers of
``total − last total``; a worker seen for the first time adds nothing (its count predates the planner), and a
counter that went down (a router restarted) adds its new value. Bucket 0 starts at ``start_s``, a multiple of
``bucket_s`` in Unix time, so ``start_bucket`` (the time of day of bucket 0) is known to the forecasters.
``to_json``/``from_json`` are the planner's checkpoint; at most ``max_buckets`` are kept (oldest dropped).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DAY_S = 86_400.0


@dataclass
class LoadHistory:
    """Requests per bucket of one zone."""

    bucket_s: float = 300.0
    max_buckets: int = 288 * 14
    start_s: float | None = None
    counts: list[float] = field(default_factory=list)
    last_totals: dict[str, float] = field(default_factory=dict)

    def observe(self, now_s: float, totals: Mapping[str, float]) -> None:
        if self.start_s is None:
            self.start_s = math.floor(now_s / self.bucket_s) * self.bucket_s
        added = 0.0
        for key, total in totals.items():
            last = self.last_totals.get(key)
            if last is not None:
                added += total - last if total >= last else total
            self.last_totals[key] = total
        for gone in set(self.last_totals) - set(totals):
            del self.last_totals[gone]
        i = self._index(now_s)
        if i >= len(self.counts):
            self.counts.extend([0.0] * (i + 1 - len(self.counts)))
        self.counts[i] += added
        self._trim()

    def _index(self, now_s: float) -> int:
        assert self.start_s is not None
        return max(int((now_s - self.start_s) // self.bucket_s), 0)

    def _trim(self) -> None:
        extra = len(self.counts) - self.max_buckets
        if extra > 0:
            del self.counts[:extra]
            assert self.start_s is not None
            self.start_s += extra * self.bucket_s

    def completed(self, now_s: float) -> np.ndarray:
        """The buckets that have ended by ``now_s`` (the one in progress is left out), oldest first."""
        if self.start_s is None:
            return np.zeros(0)
        done = min(self._index(now_s), len(self.counts))
        return np.asarray(self.counts[:done], dtype=float)

    @property
    def start_bucket(self) -> int:
        """Bucket 0's index within its day (the forecasters' time-of-day feature)."""
        return 0 if self.start_s is None else int((self.start_s % DAY_S) // self.bucket_s)

    def to_json(self) -> dict[str, Any]:
        return {"bucket_s": self.bucket_s, "start_s": self.start_s, "counts": self.counts, "totals": self.last_totals}

    @classmethod
    def from_json(cls, d: Mapping[str, Any], max_buckets: int = 288 * 14) -> LoadHistory:
        """A history from :meth:`to_json`'s output; raises ``ValueError`` naming a bad field."""
        try:
            h = cls(
                bucket_s=float(d["bucket_s"]),
                max_buckets=max_buckets,
                start_s=None if d["start_s"] is None else float(d["start_s"]),
                counts=[float(x) for x in d["counts"]],
                last_totals={str(k): float(v) for k, v in dict(d["totals"]).items()},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"planner history checkpoint: bad or missing field ({e})") from e
        if h.bucket_s <= 0:
            raise ValueError("planner history checkpoint: bucket_s must be > 0")
        if h.start_s is None and h.counts:
            # buckets with no start cannot be placed in time (the next observe would date them from its own now)
            raise ValueError("planner history checkpoint: start_s is null but counts are not empty")
        h._trim()
        return h
