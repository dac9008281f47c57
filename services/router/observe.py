"""The router request path's metrics and trace spans, recorded by small functions so the path reads as logic."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from kvmesh.routing import Decision
from kvmesh.routing.attempts import AttemptDecision
from kvmesh.routing.dataplane import PrefixPlan
from kvmesh.routing.stall import StallConfig, WorkerLatency, stall_check
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


class StallWatch:
    """One attempt's stall deadline (`kvmesh.routing.stall`): armed while the attempt waits for a message (the
    time-to-first-token bound, then the inter-token one), it cancels the request's task once
    `stall_check` says the stream is stalled; `stalled()` then tells that cancellation from any other. Feeds the
    worker's latency EWMAs. `last_report`: when the worker's last load report arrived; `elsewhere`: whether
    another worker could take the request now (without one, a stall only delays the stream: cancelling it would
    turn a slow answer into an error, so the watch keeps waiting)."""

    __slots__ = (
        "_cancelling",
        "_ceiling",
        "_cfg",
        "_elsewhere",
        "_first",
        "_handle",
        "_last_report",
        "_lat",
        "_n_new",
        "_paused",
        "_since",
        "_task",
        "fired",
    )  # fmt: skip

    def __init__(
        self,
        cfg: StallConfig,
        lat: WorkerLatency,
        n_new: int,
        last_report: Callable[[], float],
        elsewhere: Callable[[], bool],
    ) -> None:
        self._cfg, self._lat, self._n_new, self._last_report = cfg, lat, n_new, last_report
        self._elsewhere = elsewhere
        self._first = True
        self._since = 0.0
        self._paused = False
        self._ceiling = cfg.ttft_ceiling_s
        self._handle: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[Any] | None = None
        self._cancelling = 0
        self.fired = False

    @property
    def bound(self) -> float:
        """Seconds the attempt may wait for its next message now (computed when asked: a timer fires at most
        once per bound, messages come far more often)."""
        return self._lat.ttft_bound(self._cfg, self._n_new) if self._first else self._lat.itl_bound(self._cfg)

    def sent(self, t: float) -> None:
        self._since = t

    def on_step(self, t: float, tokens: bool) -> None:
        """A message arrived at `t`: a sign of life; with tokens, a latency sample and the next bound is the
        inter-token one."""
        self._lat.seen(t)
        if not tokens:
            return
        alpha = self._cfg.ewma_alpha
        if self._first:
            self._lat.on_first_token(t - self._since, self._n_new, alpha)
            self._first = False
            self._ceiling = self._cfg.itl_ceiling_s
            self.disarm()  # re-armed with the (shorter) inter-token bound: once per attempt
        else:
            self._lat.on_gap(t - self._since, alpha)
        self._since = t

    def arm(self) -> None:
        """Starts waiting for the next message now (nothing when stall detection is off). One timer per
        attempt, moved lazily when it fires: a message costs two attribute writes, not a timer."""
        if not self._cfg.enabled:
            return
        self._since = time.monotonic()
        self._paused = False
        if self._handle is None:
            if self._task is None:
                self._task = asyncio.current_task()
                self._cancelling = self._task.cancelling() if self._task is not None else 0
            self._handle = asyncio.get_running_loop().call_later(self.bound, self._check)

    def pause(self) -> None:
        """Stops waiting while the client takes a step: its pace is no worker's stall."""
        self._paused = True

    def disarm(self) -> None:
        """Stops the timer: the attempt is over, or its bound changes (the next `arm` starts it again)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def silent(self, now: float) -> bool:
        """Whether the stream counts as stalled at `now` (see `kvmesh.routing.stall.stall_check`)."""
        last = max(self._lat.last_seen, self._last_report())
        return stall_check(now, self._since, last, self.bound, self._ceiling) is None

    def _check(self) -> None:
        now = time.monotonic()
        last = max(self._lat.last_seen, self._last_report())
        nxt = now + self.bound if self._paused else stall_check(now, self._since, last, self.bound, self._ceiling)
        if nxt is None and not self._elsewhere():
            nxt = now + self.bound  # stalled, but no other worker could take it: keep waiting
        if nxt is not None:  # paused, or the stream moved on, or the worker still shows life: look again later
            self._handle = asyncio.get_running_loop().call_later(nxt - now, self._check)
            return
        self._handle = None
        if self._task is not None:
            self.fired = True
            self._task.cancel()

    def stalled(self) -> bool:
        """After a CancelledError: True when this watch cancelled the task (the cancellation is taken back)."""
        return self.fired and self._task is not None and self._task.uncancel() <= self._cancelling

    def detail(self, wid: str) -> str:
        what = "first token" if self._first else "next token"
        return f"STALLED: no {what} from {wid} within {self.bound:.2f} s, and the worker silent"


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
