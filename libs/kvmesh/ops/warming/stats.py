"""Prefix statistics over a sliding time window (time is an argument; no clock inside).

A query's prefix is observed at block *checkpoints* 1, 2, 4, … (powers of two) and at its full length:
the key of the prefix of n blocks is the chained index hash of its n-th block, which identifies the
whole prefix. `rate(key, now)` = number of observations in `(now − window_s, now]`, exact (a FIFO of
(time, key) pairs, bounded by `max_events`; overflow drops the oldest observations). Each key remembers
its parent checkpoint key so that the warming decision can prefer the longest hot prefix.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


def checkpoints(n_blocks: int) -> list[int]:
    """Block counts at which a prefix of `n_blocks` is observed: 1, 2, 4, … < n, then n."""
    out, k = [], 1
    while k < n_blocks:
        out.append(k)
        k *= 2
    if n_blocks > 0:
        out.append(n_blocks)
    return out


def checkpoint_keys(hashes: Sequence[int] | npt.NDArray[np.uint64]) -> list[int]:
    """The keys of a chain's checkpoint prefixes: `hashes[n − 1]` for each n of `checkpoints(len(hashes))`."""
    at = [n - 1 for n in checkpoints(len(hashes))]
    if isinstance(hashes, np.ndarray):
        return list(hashes[at].tolist())  # one gather (Python ints): a router calls this per routed prompt
    return [int(hashes[i]) for i in at]


@dataclass(slots=True)
class PrefixInfo:
    """What is known about one prefix key."""

    n_blocks: int
    parent: int | None
    count: int = 0
    total: int = 0
    last_seen: float = 0.0
    token_ids: tuple[int, ...] | None = None
    tenant: str | None = None  # the cache salt the prefix was queried under (warming keeps it)


class PrefixStats:
    """Sliding-window counts of prefixes (see module docstring)."""

    def __init__(
        self,
        window_s: float = 60.0,
        max_events: int = 1_000_000,
        max_keys: int = 200_000,
        keep_tokens_up_to: int = 131_072,
    ) -> None:
        self.window_s = window_s
        self.max_events = max_events
        self.max_keys = max_keys
        self.keep_tokens_up_to = keep_tokens_up_to
        self.events: deque[tuple[float, int]] = deque()
        self.info: dict[int, PrefixInfo] = {}

    def observe(
        self,
        hashes: Sequence[int],
        now: float,
        token_ids: Sequence[int] | None = None,
        block_size: int = 0,
        tenant: str | None = None,
    ) -> list[int]:
        """Count one query whose block hashes are `hashes` (tokens kept for warming when given).

        Returns the checkpoint keys observed (the caller touches the warm ones in its `HybridWarmSet`).
        """
        return self.observe_keys(len(hashes), checkpoint_keys(hashes), now, token_ids, block_size, tenant)

    def observe_keys(
        self,
        n_blocks: int,
        keys: Sequence[int],
        now: float,
        token_ids: Sequence[int] | None = None,
        block_size: int = 0,
        tenant: str | None = None,
    ) -> list[int]:
        """`observe` of a query of `n_blocks` blocks given only its `checkpoint_keys` (one per checkpoint)."""
        self.advance(now)
        parent: int | None = None
        seen: list[int] = []
        for n, k in zip(checkpoints(n_blocks), keys, strict=True):
            key = int(k)
            inf = self.info.get(key)
            if inf is None:
                if len(self.info) >= self.max_keys:
                    parent = key
                    continue
                inf = self.info[key] = PrefixInfo(n, parent, tenant=tenant)
            if (
                inf.token_ids is None
                and token_ids is not None
                and block_size > 0
                and n * block_size <= self.keep_tokens_up_to
                and len(token_ids) >= n * block_size  # a shortened prompt does not name this prefix
            ):
                inf.token_ids = tuple(token_ids[: n * block_size])
            inf.count += 1
            inf.total += 1
            inf.last_seen = now
            self.events.append((now, key))
            seen.append(key)
            parent = key
        while len(self.events) > self.max_events:
            self._expire_one()
        return seen

    def advance(self, now: float) -> None:
        """Drop observations older than the window; forget keys with no observation left in it."""
        horizon = now - self.window_s
        while self.events and self.events[0][0] <= horizon:
            self._expire_one()

    def _expire_one(self) -> None:
        _t, key = self.events.popleft()
        inf = self.info.get(key)
        if inf is not None:
            inf.count -= 1
            if inf.count <= 0:
                del self.info[key]

    def rate(self, key: int, now: float) -> int:
        """Observations of `key` in the window ending at `now`."""
        self.advance(now)
        inf = self.info.get(key)
        return inf.count if inf else 0

    def hot(self, now: float, threshold: int) -> list[tuple[int, PrefixInfo]]:
        """Keys seen ≥ threshold times in the window that have no hot extension (longest hot prefixes)."""
        self.advance(now)
        hot = {k: v for k, v in self.info.items() if v.count >= threshold}
        dominated = {v.parent for v in hot.values() if v.parent is not None}
        out = [(k, v) for k, v in hot.items() if k not in dominated]
        out.sort(key=lambda kv: (-kv[1].count, -kv[1].n_blocks, kv[0]))
        return out

    def top(self, now: float, n: int) -> list[tuple[int, PrefixInfo]]:
        """The `n` keys seen most in the window, most first (longer prefixes first among equals), O(keys · log n)."""
        self.advance(now)
        return heapq.nsmallest(n, self.info.items(), key=lambda kv: (-kv[1].count, -kv[1].n_blocks, kv[0]))

    def export(self) -> dict[str, object]:
        """Plain data for checkpoints."""
        return {
            "window_s": self.window_s,
            "events": [list(e) for e in self.events],
            "info": [
                [
                    k,
                    v.n_blocks,
                    v.parent,
                    v.count,
                    v.total,
                    v.last_seen,
                    list(v.token_ids) if v.token_ids is not None else None,
                    v.tenant,
                ]
                for k, v in self.info.items()
            ],
        }

    @classmethod
    def restore(cls, data: dict[str, object]) -> PrefixStats:
        """Inverse of `export`."""
        s = cls(window_s=float(data["window_s"]))  # type: ignore[arg-type]
        s.events = deque((float(t), int(k)) for t, k in data["events"])  # type: ignore[attr-defined]
        for k, n, p, c, tot, last, toks, *rest in data["info"]:  # type: ignore[attr-defined]
            s.info[int(k)] = PrefixInfo(
                n, p, c, tot, last, tuple(toks) if toks is not None else None, rest[0] if rest else None
            )  # snapshots before `tenant`: None
        return s
