"""Step 2 of the router's request path: hash a prompt and pick a worker for it.

Block hashes are `compute_block_hashes(prompt, block_size, make_salt(salt_model, lora, tenant))`; the index
replica gives each worker's cached prefix; the routing profile decides over the pool's views with the router's
own in-flight work applied (the decision is timed and traced).
"""

from __future__ import annotations

import time

import numpy as np

from kvmesh import hashing
from kvmesh.errors import ResourceExhausted, Unavailable
from kvmesh.routing import InflightTracker, Profile, RoutingQuery
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.services.router.observe import record_decision, record_routed
from kvmesh.services.router.workers import WorkerPool


class Placement:
    """Picks a worker for a prompt: the profile, pool, index replica and in-flight tracker it decides with."""

    def __init__(
        self,
        profile: Profile,
        pool: WorkerPool,
        index: IndexReplica,
        tracker: InflightTracker,
        block_size: int,
        salt_model: str = "",
    ) -> None:
        self.profile, self.pool, self.index, self.tracker = profile, pool, index, tracker
        self.block_size, self.salt_model = block_size, salt_model
        self._salts: dict[tuple[str, str], int] = {}

    def salt_of(self, lora: str, tenant: str) -> int:
        """Block-hash salt = `make_salt(salt_model, lora, tenant)`, as the cache-manager's `IndexHasher` salts a
        chain's first block (cached per (lora, tenant))."""
        s = self._salts.get((lora, tenant))
        if s is None:
            s = int(hashing.make_salt(self.salt_model, lora or None, tenant or None))
            if len(self._salts) < 65536:
                self._salts[(lora, tenant)] = s
        return s

    async def route(
        self,
        rid: str,
        prompt: np.ndarray,
        session: str,
        exclude: set[str],
        tenant: str = "",
        lora: str = "",
        max_tokens: int = 256,
    ) -> tuple[str, int]:
        """Picks a worker for `prompt` (uint32 token ids); returns (worker id, cached overlap tokens on it).
        Hashes are salted with `make_salt(salt_model, lora, tenant)`: one tenant never matches another's blocks."""
        bs = self.block_size
        hashes = hashing.compute_block_hashes(prompt, bs, self.salt_of(lora, tenant))
        matches = await self.index.matches(hashes, tenant=tenant, lora=lora)
        t0 = time.perf_counter()
        views = self.pool.views(time.monotonic())
        if exclude:
            views = [v for v in views if v.id not in exclude]
        self.tracker.apply(views)
        rr = RoutingQuery(rid, len(prompt), hashes, matches, bs, session_id=session, max_tokens=max_tokens)
        d = self.profile.decide(rr, views)
        record_decision(rid, d, time.perf_counter() - t0)
        if d.worker_id is None:
            if d.rejected_by == "kv-headroom":
                raise ResourceExhausted("every worker's KV cache is full", retry_after_s=1.0)
            raise Unavailable(f"no worker available (rejected by {d.rejected_by})")
        overlap = rr.overlap_tokens(d.worker_id)
        record_routed(d.worker_id, len(prompt), overlap)
        return d.worker_id, overlap
