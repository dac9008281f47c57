"""Circuit breaker per worker: slow or failing workers leave rotation, then come back through probes.

Pure: every method takes `now` (seconds, any monotonic origin). Outcomes `record(now, latency_ms, ok)`
fall into a sliding window of `window_s` seconds (at most `max_samples` kept). The breaker trips when the
window holds at least `min_samples` outcomes and

    p95(latency_ms) > p95_threshold_ms (1200)   or   errors / samples > error_rate_threshold (0.01)

(p95 = the value at rank r = ceil(0.95·n) of the n sorted latencies of successful outcomes; failures count
toward the error rate only). Checked in O(1) per outcome: p95 > T ⇔ at least n − r + 1 latencies exceed T,
so the breaker only counts the samples above T in the window. `force_open(now)` trips at once (a dead
worker: connection refused, stream reset).

    CLOSED ──trip──▶ OPEN ──cool-down elapsed──▶ HALF_OPEN ──`probe_successes` good probes──▶ CLOSED
                       ▲                              │
                       └──── a failed or slow probe ──┘   (cool-down doubles, up to max_cooldown_s)

In HALF_OPEN at most `half_open_probes` requests are in flight at once (`on_dispatch` takes a slot,
`record` returns it); `view_state(now)` reports HALF_OPEN only while a slot is free, OPEN otherwise, which
is what the `circuit-closed` filter reads. Closing resets the window and the cool-down.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from kvmesh.routing.types import CircuitState


@dataclass(frozen=True, slots=True)
class BreakerConfig:
    """Thresholds and timings of `CircuitBreaker` (defaults from the design: 1200 ms p95, 1 % errors)."""

    p95_threshold_ms: float = 1200.0
    error_rate_threshold: float = 0.01
    window_s: float = 30.0
    min_samples: int = 20
    max_samples: int = 1000
    cooldown_s: float = 5.0
    max_cooldown_s: float = 60.0
    half_open_probes: int = 1
    probe_successes: int = 2


def p95(values: list[float]) -> float:
    """The value at rank ceil(0.95·n) (1-based) of the sorted values; 0 for an empty list."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[max(math.ceil(0.95 * len(s)) - 1, 0)]


class CircuitBreaker:
    """One worker's breaker. Not thread-safe (the router calls it from one event loop)."""

    def __init__(self, config: BreakerConfig | None = None) -> None:
        self.cfg = config or BreakerConfig()
        self.state = CircuitState.CLOSED
        self.reason = ""
        self._samples: deque[tuple[float, float, bool]] = deque()
        self._errors = 0
        self._slow = 0
        self._opened_at = 0.0
        self._cooldown = self.cfg.cooldown_s
        self._probes_in_flight = 0
        self._probe_ok = 0
        self.trips = 0

    # ---- state ------------------------------------------------------------------------------------
    def _advance(self, now: float) -> None:
        if self.state is CircuitState.OPEN and now - self._opened_at >= self._cooldown:
            self.state = CircuitState.HALF_OPEN
            self._probes_in_flight = 0
            self._probe_ok = 0

    def current(self, now: float) -> CircuitState:
        """The breaker's state at `now` (OPEN turns HALF_OPEN once the cool-down has elapsed)."""
        self._advance(now)
        return self.state

    def view_state(self, now: float) -> CircuitState:
        """What routing should see: HALF_OPEN only while a probe slot is free, else OPEN."""
        st = self.current(now)
        if st is CircuitState.HALF_OPEN and self._probes_in_flight >= self.cfg.half_open_probes:
            return CircuitState.OPEN
        return st

    def retry_in(self, now: float) -> float:
        """Seconds until an OPEN breaker turns HALF_OPEN (0 if not OPEN)."""
        self._advance(now)
        if self.state is not CircuitState.OPEN:
            return 0.0
        return max(self._opened_at + self._cooldown - now, 0.0)

    def on_dispatch(self, now: float) -> None:
        """A request was sent to this worker; in HALF_OPEN it takes a probe slot."""
        self._advance(now)
        if self.state is CircuitState.HALF_OPEN:
            self._probes_in_flight += 1

    # ---- outcomes ---------------------------------------------------------------------------------
    def record(self, now: float, latency_ms: float, ok: bool) -> CircuitState:
        """Record one outcome (latency of the measured phase, success); returns the new state."""
        self._advance(now)
        cfg = self.cfg
        if self.state is CircuitState.HALF_OPEN:
            self._probes_in_flight = max(self._probes_in_flight - 1, 0)
            if ok and latency_ms <= cfg.p95_threshold_ms:
                self._probe_ok += 1
                if self._probe_ok >= cfg.probe_successes:
                    self._close()
            else:
                self._open(now, "probe failed", backoff=True)
            return self.state
        if self.state is CircuitState.OPEN:
            return self.state  # late outcome of a request sent before the trip
        self._samples.append((now, latency_ms, ok))
        if not ok:
            self._errors += 1
        elif latency_ms > cfg.p95_threshold_ms:
            self._slow += 1
        self._trim(now)
        n = len(self._samples)
        if n >= cfg.min_samples:
            err = self._errors / n
            n_ok = n - self._errors
            if err > cfg.error_rate_threshold:
                self._open(now, f"error rate {err:.3f} > {cfg.error_rate_threshold}", backoff=False)
            elif n_ok > 0 and self._slow >= n_ok - math.ceil(0.95 * n_ok) + 1:
                self._open(
                    now, f"p95 latency > {cfg.p95_threshold_ms:.0f} ms ({self._slow}/{n_ok} slow)", backoff=False
                )
        return self.state

    def force_open(self, now: float, reason: str = "forced") -> None:
        """Trip immediately (a dead worker), whatever the window says."""
        self._advance(now)
        self._open(now, reason, backoff=self.state is CircuitState.HALF_OPEN)

    def _trim(self, now: float) -> None:
        horizon = now - self.cfg.window_s
        s = self._samples
        while s and (s[0][0] < horizon or len(s) > self.cfg.max_samples):
            _, lat, ok = s.popleft()
            if not ok:
                self._errors -= 1
            elif lat > self.cfg.p95_threshold_ms:
                self._slow -= 1

    def _open(self, now: float, reason: str, backoff: bool) -> None:
        if backoff:
            self._cooldown = min(self._cooldown * 2, self.cfg.max_cooldown_s)
        self.state = CircuitState.OPEN
        self.reason = reason
        self._opened_at = now
        self._samples.clear()
        self._errors = 0
        self._slow = 0
        self._probes_in_flight = 0
        self._probe_ok = 0
        self.trips += 1

    def _close(self) -> None:
        self.state = CircuitState.CLOSED
        self.reason = ""
        self._cooldown = self.cfg.cooldown_s
        self._samples.clear()
        self._errors = 0
        self._slow = 0
        self._probes_in_flight = 0
        self._probe_ok = 0
