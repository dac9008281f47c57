"""Step 2 of the router's request path: hash a prompt and pick a worker for it.

Block hashes are `compute_block_hashes(prompt, block_size, make_salt(salt_model, lora, tenant))`; the index
replica gives each worker's cached prefix; the routing profile decides over the pool's views with the router's
own in-flight work applied (the decision is timed and traced). When a peer that serves its CPU tier holds more
of the prompt than the chosen worker and pulling it beats recomputing by `pull_margin`
(`kvmesh.routing.pull.choose_pull`), the worker gets a pull hint; its terms are logged with the decision.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from kvmesh import hashing
from kvmesh.errors import ResourceExhausted, Unavailable
from kvmesh.routing import InflightTracker, Profile, RoutingQuery
from kvmesh.routing.pull import DEFAULT_MARGIN, choose_pull
from kvmesh.routing.types import WorkerView
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.services.router.observe import record_decision, record_routed
from kvmesh.services.router.workers import WorkerPool
from kvmesh.v1 import worker_pb2

log = logging.getLogger(__name__)
PULL_HINT_TTL_MS = 5_000  # a hint older than this is not followed (the index may have moved on)


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
        pull_margin: float = DEFAULT_MARGIN,
    ) -> None:
        self.profile, self.pool, self.index, self.tracker = profile, pool, index, tracker
        self.block_size, self.salt_model = block_size, salt_model
        self.pull_margin = pull_margin  # 0: never hint a pull
        self.last_hint: worker_pb2.KvPullHint | None = None
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
        """Picks a worker for `prompt` (uint32 token ids); returns (worker id, cached overlap tokens on it) and
        leaves the pull hint for it, if any, in `last_hint` (read it before the next await).
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
        self.last_hint = self._pull_hint(rr, d.worker_id, views)
        record_routed(d.worker_id, len(prompt), overlap)
        return d.worker_id, overlap

    def _pull_hint(self, rr: RoutingQuery, wid: str, views: list[WorkerView]) -> worker_pb2.KvPullHint | None:
        """The pull hint for `wid` when a peer's pull beats recomputing by the margin (terms logged)."""
        if self.pull_margin <= 0:
            return None
        choice = choose_pull(rr, wid, views, margin=self.pull_margin)
        if choice is None:
            return None
        src = next(v for v in views if v.id == choice.source)
        log.debug(
            "request %s: pull %d tokens (%d blocks) from %s to %s: pull %.2f ms vs recompute %.2f ms",
            rr.request_id,
            choice.tokens,
            choice.blocks,
            choice.source,
            wid,
            choice.pull_s * 1e3,
            choice.recompute_s * 1e3,
        )
        return worker_pb2.KvPullHint(
            source_worker_id=src.id,
            source_address=src.kvsync_address,
            region=src.tier_region,
            region_shm_name=src.tier_shm_name,
            num_blocks=choice.blocks,
            expires_unix_ms=int(time.time() * 1000) + PULL_HINT_TTL_MS,
        )
