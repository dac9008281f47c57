"""The worker's batching window (`--batching-window-ms`, off by default): a generation request waits in a
`kvmesh.engine.batching.BatchWindow` and enters the engine when a release lets it through, in the window's
order (shortest prompt first, packed under `--batching-token-budget`).

Both engines and every entry point (gRPC `Generate`, `GenerateStream`, the OpenAI routes) await
`WindowGate.admit(req)` just before they open the engine stream. A release resolves the waiters' futures in
release order; each waiter then opens its engine stream before it yields to the loop again, so the requests
enter the engine in that order. A waiter cancelled (client gone, deadline, `cancel_request_id`) leaves the
window and never reaches the engine. The window is timed by the event loop's monotonic clock; a full window
answers RESOURCE_EXHAUSTED with the time to its next release. Metrics: `kvmesh_worker_batching_wait_seconds`
(time in the window), `kvmesh_worker_batching_release_requests` (requests per release).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from kvmesh.core.generation import EngineRequest
from kvmesh.engine.batching import BatchWindow, WindowConfig
from kvmesh.services.worker import metrics as m
from kvmesh.services.worker.settings import WorkerSettings

TEXT_BYTES_PER_TOKEN = 4  # a text prompt's length estimate (token ids are counted exactly)


class Cancellable(Protocol):
    def cancel(self) -> None: ...


Schedule = Callable[[float, Callable[[], None]], Cancellable]  # (when, callback) -> a handle; loop.call_at


def prompt_length(req: EngineRequest) -> int:
    """Prompt tokens: the token ids when given, else the text's UTF-8 bytes / TEXT_BYTES_PER_TOKEN."""
    if req.prompt_token_ids is not None:
        return len(req.prompt_token_ids)
    return len((req.prompt or "").encode()) // TEXT_BYTES_PER_TOKEN + 1


def window_config(s: WorkerSettings) -> WindowConfig | None:
    """The window the settings ask for; None when `--batching-window-ms` is 0 (off). Bad values raise
    InvalidArgument naming the field."""
    if s.batching_window_ms == 0:
        return None
    gen = s.batching_generation_window_ms
    return WindowConfig(
        window_s=s.batching_window_ms / 1000.0,
        generation_window_s=gen / 1000.0 if gen else None,
        generation_max_tokens=s.batching_generation_max_tokens,
        token_budget=s.batching_token_budget,
        max_waiting=s.max_queue,
    )


class WindowGate:
    """A batching window on an asyncio loop. `clock` and `schedule` default to the running loop's `time` and
    `call_at` (a test may pass its own)."""

    def __init__(
        self, config: WindowConfig, clock: Callable[[], float] | None = None, schedule: Schedule | None = None
    ) -> None:
        self.window: BatchWindow[str] = BatchWindow(config)
        self._clock = clock
        self._schedule = schedule
        self._ready: dict[str, asyncio.Future[None]] = {}
        self._timer: Cancellable | None = None
        self._timer_due: float | None = None

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    async def admit(self, req: EngineRequest) -> None:
        """Wait until a release lets `req` into the engine; raises what `BatchWindow.add` raises."""
        rid, start = req.request_id, self._now()
        due = self.window.add(rid, prompt_length(req), req.sampling.max_tokens, start)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._ready[rid] = fut
        self._arm(due)
        try:
            await fut
        except asyncio.CancelledError:
            self._ready.pop(rid, None)
            if self.window.remove(rid):
                self._rearm()
            raise
        m.BATCHING_WAIT.observe(self._now() - start)

    def _arm(self, due: float) -> None:
        if self._timer_due is not None and self._timer_due <= due:
            return
        if self._timer is not None:
            self._timer.cancel()
        schedule = self._schedule or asyncio.get_running_loop().call_at
        self._timer, self._timer_due = schedule(due, self._fire), due

    def _rearm(self) -> None:
        """After a removal: the next release is due when the window now says (nothing waiting: no timer)."""
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timer_due = None
        due = self.window.due()
        if due is not None:
            self._arm(due)

    def _fire(self) -> None:
        self._timer = self._timer_due = None
        batch = self.window.release(self._now())
        m.BATCHING_RELEASE.observe(len(batch))
        for rid in batch:
            fut = self._ready.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        due = self.window.due()
        if due is not None:
            self._arm(due)
