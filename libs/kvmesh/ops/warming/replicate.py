"""Which hot prefixes to replicate into another zone, under a byte budget (pure; time is an argument).

A hot prefix chain p (the longest hot prefix of `PrefixStats.hot`, with its tokens known) is worth

    value(p) = hits(p) · tokens(p)        hits in the statistics window, tokens = n_blocks · block_size

prefill tokens saved if zone A's sessions land on the other zone. Each round the candidates not yet
replicated there go in decreasing value (ties: the longer prefix, then the key) while their bytes,
n_blocks · block_bytes, fit the round's allowance; one that does not fit is skipped, so a smaller one may
still go. The allowance is a token bucket: `rate` bytes/s refill, at most `burst` bytes held, spent by what a
round sends, so replication never takes more than `rate` on average however often it runs; a prefix larger
than `burst` never goes (it would never fit). Replicas are immutable and content-addressed: once verified,
a prefix is not sent again while the other zone still holds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvmesh.ops.warming.stats import PrefixInfo


@dataclass(frozen=True, slots=True)
class Candidate:
    """A hot prefix that could be replicated."""

    key: int
    token_ids: tuple[int, ...]
    tenant: str | None
    n_blocks: int
    hits: int

    def value(self, block_size: int) -> int:
        """hits · tokens: prefill tokens a replica saves."""
        return self.hits * self.n_blocks * block_size


def candidates(hot: Iterable[tuple[int, PrefixInfo]]) -> list[Candidate]:
    """The hot prefixes whose tokens are known (only those can be replicated)."""
    return [
        Candidate(k, inf.token_ids, inf.tenant, inf.n_blocks, inf.count)
        for k, inf in hot
        if inf.token_ids is not None and inf.n_blocks > 0
    ]


class ByteBudget:
    """A token bucket of bytes: `rate` per second, at most `burst` held (full at start)."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate, self.burst = rate, burst
        self.level, self.at = burst, now

    def available(self, now: float) -> float:
        """Bytes that may be sent now."""
        self.level = min(self.burst, self.level + max(0.0, now - self.at) * self.rate)
        self.at = max(self.at, now)
        return self.level

    def spend(self, n: float) -> None:
        """Take `n` bytes (what a round sent)."""
        self.level -= n


def plan_round(
    cands: Sequence[Candidate],
    replicated: set[int],
    allowance: float,
    block_size: int,
    block_bytes: int,
    max_prefixes: int,
) -> list[Candidate]:
    """The round's prefixes: not yet replicated, by decreasing value, while their bytes fit `allowance`."""
    order = sorted(
        (c for c in cands if c.key not in replicated), key=lambda c: (-c.value(block_size), -c.n_blocks, c.key)
    )
    out: list[Candidate] = []
    left = allowance
    for c in order:
        if len(out) >= max_prefixes:
            break
        cost = c.n_blocks * block_bytes
        if cost <= left:
            out.append(c)
            left -= cost
    return out


def unfinished(
    cands: Iterable[Candidate],
    replicated: set[int],
    block_bytes: int,
    burst: float,
    held_here: Callable[[Candidate], bool],
) -> bool:
    """Whether a candidate that could still go is not replicated: one this zone holds (`held_here`) whose
    bytes fit the burst (a larger one never goes); `block_bytes` 0 (no tier here) means nothing can go."""
    return block_bytes > 0 and any(
        c.key not in replicated and c.n_blocks * block_bytes <= burst and held_here(c) for c in cands
    )
