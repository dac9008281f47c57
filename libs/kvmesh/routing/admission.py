"""Long/short admission queues: long prompts wait in their own bounded queue with their own concurrency.

    class(r) = "long" if prompt_tokens(r) > long_prompt_tokens (default 2048) else "short"

Each class c has `max_concurrency_c` running slots and a queue of at most `max_queue_c` waiting requests,
served by priority (a request's `priority`: the lowest value first, first come first served within one, as
vLLM's `--scheduling-policy priority`; all 0: a FIFO). `admit` grants a slot if one is free and nobody of
that class waits, else queues the request (a full queue refuses it whatever its priority: the router never
drops a request it has queued), else raises `ResourceExhausted(retry_after_s)` with

    retry_after_s = clip(ewma_service_s_c · (queued_c + 1) / max_concurrency_c, min_retry_s, max_retry_s)

(`ewma_service_s_c` is an exponentially weighted mean of the class's slot-holding times, alpha = 0.2).
`release` frees a slot and returns the ids that now hold slots, in that order; short requests never wait
behind long ones because the classes share nothing. Pure: `now` is passed in, the service turns grants into
awakened futures.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from kvmesh.core.errors import InvalidArgument, ResourceExhausted


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """Limits of one class of requests."""

    max_concurrency: int
    max_queue: int

    def __post_init__(self) -> None:
        if self.max_concurrency < 1 or self.max_queue < 0:
            raise InvalidArgument("queue", "max_concurrency must be >= 1 and max_queue >= 0")


@dataclass(slots=True)
class _Class:
    limits: QueueLimits
    running: dict[str, float]
    ewma_s: float
    waiting: dict[str, int] = field(default_factory=dict)  # id -> its arrival number (`order`'s tiebreak)
    # (priority, arrival number, id) of the waiting; a cancelled one's entry stays until it comes up (or
    # `admit` compacts the heap): `waiting` says whether an entry is live
    order: list[tuple[int, int, str]] = field(default_factory=list)

    def queue(self, request_id: str, priority: int, arrival: int) -> None:
        self.waiting[request_id] = arrival
        heapq.heappush(self.order, (priority, arrival, request_id))
        if len(self.order) > 2 * len(self.waiting) + 16:  # bounded by the live ones, however many cancel
            self.order = [e for e in self.order if self.waiting.get(e[2]) == e[1]]
            heapq.heapify(self.order)

    def next_waiting(self) -> str:
        """Pops the first waiting request: the lowest priority value, the earliest within it."""
        while True:
            _, arrival, rid = heapq.heappop(self.order)
            if self.waiting.get(rid) == arrival:
                del self.waiting[rid]
                return rid


class Admission:
    """Two independent classes, "short" and "long"; `admit` → True (run now) / False (queued) / raises."""

    ALPHA = 0.2

    def __init__(
        self,
        short: QueueLimits,
        long: QueueLimits,
        long_prompt_tokens: int = 2048,
        min_retry_s: float = 1.0,
        max_retry_s: float = 60.0,
        initial_service_s: float = 1.0,
    ) -> None:
        self.long_prompt_tokens = long_prompt_tokens
        self.min_retry_s, self.max_retry_s = min_retry_s, max_retry_s
        self._classes = {
            "short": _Class(short, {}, initial_service_s),
            "long": _Class(long, {}, initial_service_s),
        }
        self._class_of: dict[str, str] = {}
        self._arrivals = 0

    def class_of(self, prompt_tokens: int) -> str:
        return "long" if prompt_tokens > self.long_prompt_tokens else "short"

    def admit(self, request_id: str, prompt_tokens: int, now: float, priority: int = 0) -> bool:
        """True: holds a slot now. False: queued by `priority` (wait for `release` to return its id). Raises
        when full."""
        if request_id in self._class_of:
            raise InvalidArgument("request_id", f"{request_id!r} is already admitted")
        name = self.class_of(prompt_tokens)
        c = self._classes[name]
        if len(c.running) < c.limits.max_concurrency and not c.waiting:
            c.running[request_id] = now
            self._class_of[request_id] = name
            return True
        if len(c.waiting) >= c.limits.max_queue:
            raise ResourceExhausted(
                f"{name} queue full ({len(c.waiting)} waiting, {len(c.running)} running)",
                retry_after_s=self.retry_after(name),
            )
        self._arrivals += 1
        c.queue(request_id, priority, self._arrivals)
        self._class_of[request_id] = name
        return False

    def retry_after(self, name: str) -> float:
        c = self._classes[name]
        est = c.ewma_s * (len(c.waiting) + 1) / c.limits.max_concurrency
        return min(max(est, self.min_retry_s), self.max_retry_s)

    def release(self, request_id: str, now: float) -> list[str]:
        """The request ended or was cancelled; returns the ids granted a slot by this release."""
        name = self._class_of.pop(request_id, None)
        if name is None:
            return []
        c = self._classes[name]
        if request_id in c.waiting:
            del c.waiting[request_id]
            return []
        started = c.running.pop(request_id)
        c.ewma_s = (1 - self.ALPHA) * c.ewma_s + self.ALPHA * max(now - started, 0.0)
        granted: list[str] = []
        while c.waiting and len(c.running) < c.limits.max_concurrency:
            rid = c.next_waiting()
            c.running[rid] = now
            granted.append(rid)
        return granted

    def is_running(self, request_id: str) -> bool:
        name = self._class_of.get(request_id)
        return name is not None and request_id in self._classes[name].running

    def stats(self) -> dict[str, dict[str, int]]:
        """{class: {running, waiting}} for the queue-length gauges."""
        return {n: {"running": len(c.running), "waiting": len(c.waiting)} for n, c in self._classes.items()}
