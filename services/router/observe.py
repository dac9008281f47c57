"""The router request path's metrics and trace spans, recorded by small functions so the path reads as logic."""

from __future__ import annotations

import json
import logging

from kvmesh.routing import Decision
from kvmesh.routing.attempts import AttemptDecision
from kvmesh.routing.dataplane import PrefixPlan
from kvmesh.services.router import metrics as m
from kvmesh.telemetry.tracing import recording, tracer

log = logging.getLogger(__name__)
_TRACER = tracer("kvmesh.router")


def record_decision(rid: str, d: Decision, elapsed_s: float) -> None:
    """A routing decision: its latency, and a `route` span (when tracing records) with the decision's log."""
    m.DECISION.observe(elapsed_s)
    if recording():
        with _TRACER.start_as_current_span("route") as span:
            span.set_attribute("kvmesh.request_id", rid)
            span.set_attribute("kvmesh.worker", d.worker_id or "")
            span.set_attribute("kvmesh.decision", json.dumps(d.to_log()))


def record_pd(disaggregated: bool, reason: str) -> None:
    """A prefill/decode decision (on a fleet with prefill workers)."""
    m.PD_DECISIONS.labels("disaggregated" if disaggregated else "aggregated", reason).inc()


def record_prefix(plan: PrefixPlan, hint: str) -> None:
    """The chosen worker's prefix plan: its blocks by source, and the pull hint's outcome ("" = none)."""
    for source, n in (("gpu", plan.gpu_blocks), ("load", plan.load_blocks), ("pull", plan.pull_blocks)):
        if n:
            m.PREFIX_BLOCKS.labels(source).inc(n)
    if hint:
        m.PULL_HINTS.labels(hint).inc()


def record_routed(worker_id: str, n_prompt: int, overlap: int) -> None:
    """A request routed to `worker_id` with `overlap` of its `n_prompt` tokens cached there."""
    m.SELECTIONS.labels(worker_id).inc()
    m.ROUTED_PROMPT_TOKENS.inc(n_prompt)
    m.ROUTED_CACHED_TOKENS.inc(overlap)


class StreamClock:
    """Times one request's stream: TTFT and ITL as the client sees them (across attempts, into the router's
    histograms) and the current attempt's worst inter-token gap (the breaker's sample; 0 with one message:
    time to first token grows with the prompt and the queue, so it is no sign of a sick worker)."""

    __slots__ = ("_first", "_last_emit", "_n_steps", "_t_prev", "max_gap_ms", "started")

    def __init__(self, started: float) -> None:
        self.started = started
        self._first = False
        self._last_emit = started
        self._t_prev = started
        self._n_steps = 0
        self.max_gap_ms = 0.0

    def new_attempt(self, t: float) -> None:
        self._t_prev = t
        self._n_steps = 0
        self.max_gap_ms = 0.0

    def on_tokens(self, t: float) -> bool:
        """A step with tokens arrived at `t`; True when it is the attempt's first."""
        first = self._n_steps == 0
        if not first:
            self.max_gap_ms = max(self.max_gap_ms, (t - self._t_prev) * 1000)
        self._n_steps += 1
        self._t_prev = t
        if not self._first:
            self._first = True
            m.TTFT.observe(t - self.started)
        else:
            m.ITL.observe(t - self._last_emit)
        self._last_emit = t
        return first

    def on_finish(self, t: float) -> None:
        m.E2E.observe(t - self.started)


def record_attempt_end(rid: str, wid: str, d: AttemptDecision, n_so_far: int, stalled: bool = False) -> None:
    """Counts and logs an attempt's retry or migration (and a stall)."""
    if stalled:
        m.STALLS.inc()
    if d.retry:
        m.RETRIES.inc()
        log.warning("request %s: worker %s failed before its first token (%s); retry %d", rid, wid, d.reason, d.retry)
    elif d.migration:
        m.MIGRATIONS.inc()
        log.warning(
            "request %s: worker %s failed after %d tokens (%s); migration %d", rid, wid, n_so_far, d.reason, d.migration
        )
