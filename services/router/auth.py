"""Per-key token-bucket rate limits. Pure: `now` is passed in. (API keys, tenants and signed requests:
`kvmesh.security.client_keys` and `kvmesh.security.signing`.)

Rate limit per key: a bucket of `burst` tokens refilled at `rate` per second;

    tokens(now) = min(burst, tokens(t_last) + rate · (now − t_last))
    allow ⇔ tokens(now) ≥ 1  (then tokens −= 1), else retry_after = (1 − tokens(now)) / rate
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.core.errors import ResourceExhausted


@dataclass(slots=True)
class _Bucket:
    tokens: float
    last: float


class RateLimiter:
    """Token bucket per key; `rate <= 0` disables limiting. Bounded: at most `max_keys` buckets."""

    def __init__(self, rate: float, burst: float, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.burst = max(burst, 1.0)
        self.max_keys = max_keys
        self._buckets: dict[str, _Bucket] = {}

    def acquire(self, key: str, now: float) -> None:
        """Take one token for `key` or raise ResourceExhausted with the time until the next token."""
        if self.rate <= 0:
            return
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets.pop(next(iter(self._buckets)))
            b = self._buckets[key] = _Bucket(self.burst, now)
        b.tokens = min(self.burst, b.tokens + self.rate * max(now - b.last, 0.0))
        b.last = now
        if b.tokens >= 1.0:
            b.tokens -= 1.0
            return
        raise ResourceExhausted("rate limit exceeded for this API key", retry_after_s=(1.0 - b.tokens) / self.rate)
