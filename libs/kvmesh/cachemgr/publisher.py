"""Per-stream rules of a KV event publisher: who may publish for which worker, and how much (pure, no clock).

* **Identity.** A caller whose identity is known may publish only for itself: role ``worker`` and id equal to
  the worker id of every hello and batch on the stream. Anything else is PERMISSION_DENIED naming both, before
  the message touches the index (so a forged hello with a new ``instance_id`` cannot wipe the real worker's
  entries). An unknown identity (the service runs without authentication) publishes for any worker, as before.
* **Workers per stream.** At most ``max_workers`` distinct worker ids on one stream (a kvmesh worker uses one):
  the next one is RESOURCE_EXHAUSTED.
* **Blocks per stream.** A token bucket over stored blocks: ``burst`` blocks at once (a worker's full dump must
  fit), refilled at ``blocks_per_s``; tokens(t) = min(burst, tokens(t0) + (t - t0) · blocks_per_s). A message
  storing more blocks than the bucket holds is RESOURCE_EXHAUSTED with ``retry_after_s`` = deficit /
  blocks_per_s (the time until it would fit), and nothing of it is applied; a message larger than the
  burst never fits (retry after 60 s, in smaller chunks: kvmesh workers send dumps in chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.core.errors import PermissionDenied, ResourceExhausted
from kvmesh.security.identity import CallerRole, Identity


@dataclass(frozen=True)
class PublishLimits:
    """Bounds of one publisher stream (see the module docstring)."""

    max_workers: int = 4
    burst_blocks: int = 524_288
    blocks_per_s: float = 131_072.0


@dataclass
class PublisherGuard:
    """The rules of one PublishKvEvents stream; `caller` None = no authentication."""

    caller: Identity | None
    limits: PublishLimits
    started_at: float
    workers: set[str] = field(default_factory=set)
    tokens: float = -1.0
    at: float = 0.0

    def __post_init__(self) -> None:
        self.tokens, self.at = float(self.limits.burst_blocks), self.started_at

    def admit_worker(self, worker_id: str, field_name: str) -> None:
        """`worker_id` (from `field_name` of a message) may be published for on this stream, or raise."""
        c = self.caller
        if c is not None and (c.role is not CallerRole.WORKER or c.id != worker_id):
            raise PermissionDenied(
                f"{field_name}: caller {c} may not publish KV events for worker {worker_id!r} "
                f"(only a worker publishes, and only for its own id)"
            )
        if worker_id in self.workers:
            return
        if len(self.workers) >= self.limits.max_workers:
            raise ResourceExhausted(
                f"{field_name}: a publisher stream may carry at most {self.limits.max_workers} workers "
                f"(worker {worker_id!r} would be the {len(self.workers) + 1}th)",
                1.0,
            )
        self.workers.add(worker_id)

    def admit_blocks(self, n: int, now: float) -> None:
        """`n` stored blocks may be applied now (taken from the bucket), or raise RESOURCE_EXHAUSTED."""
        lim = self.limits
        self.tokens = min(float(lim.burst_blocks), self.tokens + max(0.0, now - self.at) * lim.blocks_per_s)
        self.at = now
        if n > self.tokens:
            deficit = n - self.tokens
            raise ResourceExhausted(
                f"batch: {n} stored blocks exceed this stream's budget ({int(self.tokens)} left of "
                f"{lim.burst_blocks}, refilled at {lim.blocks_per_s:g}/s)",
                deficit / lim.blocks_per_s if n <= lim.burst_blocks else 60.0,
            )
        self.tokens -= n
