"""Stall bounds: how long a worker's stream may go without a token before the router gives up on it (pure).

A worker frozen by SIGSTOP, a GC pause, a swap storm or a hung GPU keeps its connection open and sends
nothing; only silence tells. Each worker's own recent latencies set its bounds (`WorkerLatency`, EWMAs fed
by the router's request path):

    itl_bound(w)  = clamp(itl_factor · ewma_gap(w),                    itl_floor_s,  itl_ceiling_s)
    ttft_bound(w) = clamp(ttft_factor · ewma_ttft_per_token(w) · n,    ttft_floor_s, ttft_ceiling_s)

where `ewma_gap` is the EWMA of the gaps between a stream's messages on w, `ewma_ttft_per_token` the EWMA of
time-to-first-token divided by the prompt tokens w had to compute, and n the new request's. A worker without
samples yet gets the ceiling (nothing is known, so only the worst case is bounded).

Defaults: a decode step takes milliseconds to tens of milliseconds (sim and vLLM alike), so 10 × the mean gap
is far above a slow step and any clamp at the floor of 1 s leaves a worker's GC pause (~100 ms) alone while
keeping a frozen stream's cost under the 3 s the issue asks for; the ceiling of 5 s bounds a worker whose
history is slow (big batches) or unknown. Time to first token grows with the prompt and the queue, so its
floor (1.5 s: a retry after it still ends within 3 s) and ceiling (30 s: a 100K-token prefill) are wider.

A stream past its bound is stalled only when its worker is silent too (`stall_check`): no message on any of
its streams and no load report for the bound. A frozen worker sends nothing at all; a busy one (a long queue,
a preempted request recomputing) still reports, and is waited for up to the ceiling: retrying its requests
elsewhere and opening its circuit would turn load into failures.

`report_age_bound`: load reports that stop arriving make a worker unroutable after
clamp(report_age_intervals · interval, report_age_floor_s, ceiling_s).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StallConfig:
    """Stall-bound parameters (see the module docstring); `enabled=False` never bounds a stream."""

    enabled: bool = True
    itl_factor: float = 10.0
    itl_floor_s: float = 1.0
    itl_ceiling_s: float = 5.0
    ttft_factor: float = 5.0
    ttft_floor_s: float = 1.5
    ttft_ceiling_s: float = 30.0
    ewma_alpha: float = 0.2
    hedge: bool = False


def clamp(x: float, lo: float, hi: float) -> float:
    """`x` within [lo, hi] (lo wins if lo > hi)."""
    return max(lo, min(x, hi))


def ewma(prev: float | None, sample: float, alpha: float) -> float:
    """The exponentially weighted mean after `sample` (the sample itself when there is no mean yet)."""
    return sample if prev is None else prev + alpha * (sample - prev)


class WorkerLatency:
    """One worker's recent latencies: the EWMAs its stall bounds derive from."""

    __slots__ = ("gap_s", "last_seen", "ttft_per_token_s")

    def __init__(self) -> None:
        self.gap_s: float | None = None
        self.ttft_per_token_s: float | None = None
        self.last_seen = float("-inf")  # the worker's last message on any stream

    def seen(self, t: float) -> None:
        """A message from this worker arrived at `t` (a sign of life)."""
        self.last_seen = max(self.last_seen, t)

    def on_gap(self, gap_s: float, alpha: float) -> None:
        """A gap of `gap_s` between two messages of one stream on this worker."""
        self.gap_s = ewma(self.gap_s, max(gap_s, 0.0), alpha)

    def on_first_token(self, ttft_s: float, prompt_tokens: int, alpha: float) -> None:
        """A first token after `ttft_s` for a request with `prompt_tokens` tokens to compute."""
        self.ttft_per_token_s = ewma(self.ttft_per_token_s, max(ttft_s, 0.0) / max(prompt_tokens, 1), alpha)

    def itl_bound(self, cfg: StallConfig) -> float:
        """Seconds a stream on this worker may wait for its next message."""
        if self.gap_s is None:
            return cfg.itl_ceiling_s
        return clamp(cfg.itl_factor * self.gap_s, cfg.itl_floor_s, cfg.itl_ceiling_s)

    def ttft_bound(self, cfg: StallConfig, prompt_tokens: int) -> float:
        """Seconds a request of `prompt_tokens` tokens to compute may wait for its first token here."""
        if self.ttft_per_token_s is None:
            return cfg.ttft_ceiling_s
        want = cfg.ttft_factor * self.ttft_per_token_s * max(prompt_tokens, 1)
        return clamp(want, cfg.ttft_floor_s, cfg.ttft_ceiling_s)


def stall_check(now: float, waiting_since: float, last_seen: float, bound: float, ceiling: float) -> float | None:
    """When to look again at a stream waiting since `waiting_since` for its next message from a worker last
    seen alive (any message or load report) at `last_seen`; None: the stream is stalled, because it waited
    `ceiling`, or it and its worker have both been silent for `bound`."""
    quiet_since = max(last_seen, waiting_since)
    if now - waiting_since >= ceiling or now - quiet_since >= bound:
        return None
    return min(waiting_since + ceiling, quiet_since + bound)


def report_age_bound(interval_s: float, intervals: float, floor_s: float, ceiling_s: float) -> float:
    """Seconds without a load report after which a worker is unroutable (see the module docstring)."""
    return clamp(intervals * interval_s, floor_s, ceiling_s)
