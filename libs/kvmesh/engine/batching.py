"""Length-aware batching window: requests wait a short window before they enter the engine, and each release
hands them over shortest prompt first, packed under a token budget (seed 000 §6.2, seed 003 §3.2).

The rule (times are passed in; nothing here reads a clock):

* Class. A request is *generation* when its ``max_tokens`` is at least ``generation_max_tokens`` (or unset),
  else *question answering*. Its window is ``window_s`` (QA; the seeds use 50–100 ms) or
  ``generation_window_s`` (generation; the seeds use 100–200 ms).
* Due time. A request added at ``t`` is due at ``t + window(class)``; the next release is due at

      due = min over waiting requests r of r.due

  so a window opens with the first request that finds none waiting and closes at the earliest deadline of
  what it gathered.
* Release (``release(now)``, called at ``due``). Order every waiting request: those carried over from an
  earlier release first (in their earlier order), then the others by prompt length ascending (ties: arrival
  order). Release the longest leading run of that order whose prompt tokens sum to at most
  ``token_budget``, and always at least one request (a prompt larger than the budget still goes, alone).
  The rest are carried over and are due again ``window(class)`` after this release. Carried requests go
  first, so each release moves the carried queue on: no request waits forever behind shorter newcomers.
* Bounds. At most ``max_waiting`` requests wait; ``add`` beyond that raises ``ResourceExhausted`` with
  ``retry_after_s`` = the time until the next release. A request id already waiting is ``InvalidArgument``.
* Cancellation. ``remove(id)`` takes a request out; it is never released.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvmesh.core.errors import InvalidArgument, ResourceExhausted

K = TypeVar("K", bound=Hashable)


@dataclass(frozen=True, slots=True)
class WindowConfig:
    """Knobs of a batching window (see the module docstring). ``generation_window_s=None``: twice
    ``window_s`` (the seeds' generation range is twice their QA range)."""

    window_s: float
    generation_window_s: float | None = None
    generation_max_tokens: int = 256
    token_budget: int = 16384
    max_waiting: int = 256

    def __post_init__(self) -> None:
        if not self.window_s > 0:
            raise InvalidArgument("window_s", f"must be > 0 (0 turns the window off), got {self.window_s}")
        if self.generation_window_s is not None and not self.generation_window_s > 0:
            raise InvalidArgument("generation_window_s", f"must be > 0, got {self.generation_window_s}")
        if self.token_budget < 1:
            raise InvalidArgument("token_budget", f"must be at least 1 token, got {self.token_budget}")
        if self.max_waiting < 1:
            raise InvalidArgument("max_waiting", f"must be at least 1, got {self.max_waiting}")

    def window_for(self, max_tokens: int | None) -> float:
        """The window of a request with this ``max_tokens`` (None: unbounded, so generation)."""
        if max_tokens is not None and max_tokens < self.generation_max_tokens:
            return self.window_s
        return self.generation_window_s if self.generation_window_s is not None else 2.0 * self.window_s


@dataclass(slots=True)
class _Waiting:
    prompt_tokens: int
    window_s: float
    due: float
    order: int
    carried: bool = False


@dataclass(slots=True)
class BatchWindow(Generic[K]):
    """Requests (keyed by an id of the caller's choice) waiting for their release; see the module docstring."""

    config: WindowConfig
    _waiting: dict[K, _Waiting] = field(default_factory=dict)
    _carried: list[K] = field(default_factory=list)  # in release order
    _arrivals: itertools.count[int] = field(default_factory=itertools.count)

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, key: object) -> bool:
        return key in self._waiting

    def due(self) -> float | None:
        """When the next release is due; None when nothing waits."""
        return min((w.due for w in self._waiting.values()), default=None)

    def add(self, key: K, prompt_tokens: int, max_tokens: int | None, now: float) -> float:
        """Queue a request; returns the (possibly earlier) due time of the next release."""
        if key in self._waiting:
            raise InvalidArgument("request_id", f"{key!r} is already waiting in the batching window")
        if len(self._waiting) >= self.config.max_waiting:
            due = self.due()
            wait = max(0.0, due - now) if due is not None else 0.0
            raise ResourceExhausted(f"batching window full ({self.config.max_waiting} waiting)", retry_after_s=wait)
        win = self.config.window_for(max_tokens)
        self._waiting[key] = _Waiting(max(0, prompt_tokens), win, now + win, next(self._arrivals))
        due = self.due()
        assert due is not None
        return due

    def remove(self, key: K) -> bool:
        """Take a waiting request out (cancelled); True when it was waiting."""
        w = self._waiting.pop(key, None)
        if w is None:
            return False
        if w.carried:
            self._carried.remove(key)
        return True

    def release(self, now: float) -> list[K]:
        """The requests that enter the engine now, in the order they should enter it (module docstring)."""
        fresh = sorted(
            (k for k, w in self._waiting.items() if not w.carried),
            key=lambda k: (self._waiting[k].prompt_tokens, self._waiting[k].order),
        )
        order = self._carried + fresh
        out: list[K] = []
        used = 0
        for k in order:
            tokens = self._waiting[k].prompt_tokens
            if out and used + tokens > self.config.token_budget:
                break
            out.append(k)
            used += tokens
        for k in out:
            del self._waiting[k]
        self._carried = order[len(out) :]
        for k in self._carried:
            w = self._waiting[k]
            w.carried = True
            w.due = now + w.window_s
        return out
