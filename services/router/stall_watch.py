"""One attempt's stall watch: the timer that cancels a request's task when its worker's stream has gone silent
for longer than the worker's stall bound (`kvmesh.routing.stall`: the bounds and the verdict are pure, the
timer and the cancellation are this module's)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kvmesh.routing.stall import StallConfig, WorkerLatency, stall_check


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
