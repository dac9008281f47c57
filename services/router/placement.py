"""Step 2 of the router's request path: hash a prompt and pick a worker for it.

Block hashes are `compute_block_hashes(prompt, block_size, make_salt(salt_model, lora, tenant))`; the index
replica gives each worker's match split by medium (its leading GPU run, and what it holds only in its host
tiers); the routing profile decides over the pool's views with the router's own in-flight work applied (the
decision is timed and traced). The query carries, per worker w (`kvmesh.routing.dataplane`):

    matches[w]      = the GPU run                  tier_matches[w] = GPU run + tier blocks (+ a pending pull)
    pull_sources[w] = tier_matches[w] for the workers that serve their tier (kvsync address), healthy, circuit
                      not open (a draining one still serves)      peer_pulls = pull_margin > 0

so the cost prices, for every candidate with transfer costs (its GetInfo), GPU hits, tier loads, a peer pull
and the recompute in one unit. The chosen worker's `PrefixPlan` is the one pricer of the pull hint: when it
pulls, the decision (`Routed`) carries a `KvPull` (kvmesh.core.pull) for the prompt's leading
`min(covered, (P − 1) // block_size)` blocks from the plan's source (the block holding the last token is
always computed). A hinted pull is remembered (`PendingPulls`) until its hint expires: the next request for
that prefix on that worker sees the blocks as the worker's own tier and gets the same hint again, so the
worker joins the running pull (it pulls once).
Every term of the plan is logged with the decision (`Decision.prefix`) and counted in the router's metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from kvmesh.core.errors import ResourceExhausted, Unavailable
from kvmesh.core.handoff import WorkerRole
from kvmesh.core.pull import KvPull
from kvmesh.index import hashing
from kvmesh.replica.media import PrefixMatches
from kvmesh.routing import InflightTracker, Profile, RoutingQuery
from kvmesh.routing.dataplane import DEFAULT_PULL_MARGIN, PrefixPlan, plan_prefix, sources_of
from kvmesh.routing.disagg import PdDecision, PdParams
from kvmesh.routing.disagg import decide as decide_pd
from kvmesh.routing.inflight import PendingPull, PendingPulls
from kvmesh.routing.types import CircuitState, Decision, WorkerView
from kvmesh.services.router.disaggregation import PrefillHalf
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.services.router.observe import record_decision, record_pd, record_prefix, record_routed
from kvmesh.services.router.workers import WorkerPool

log = logging.getLogger(__name__)
PULL_HINT_TTL_MS = 5_000  # a hint older than this is not followed (the index may have moved on)


def _serves_pulls(v: WorkerView) -> bool:
    """A peer may be pulled from: it serves its tier and is healthy with its circuit not open (draining is fine)."""
    return bool(v.kvsync_address) and v.healthy and v.circuit is not CircuitState.OPEN


@dataclass(frozen=True, slots=True)
class Routed:
    """Placement's decision for one attempt: the worker, the prompt tokens it need not compute (GPU hit,
    tier load, pull), and the pull it is told to make, if any. A disaggregated decision also names its
    `prefill` half's worker (`worker_id` is then the decode worker; `overlap` what the handoff covers)."""

    worker_id: str
    overlap: int
    pull: KvPull | None = None
    prefill: PrefillHalf | None = None


def plan_terms(plan: PrefixPlan) -> dict[str, object]:
    """The plan's terms for the decision log (blocks, source, seconds)."""
    return {
        "gpu_blocks": plan.gpu_blocks,
        "load_blocks": plan.load_blocks,
        "pull_blocks": plan.pull_blocks,
        "source": plan.source or "",
        "recompute_tokens": plan.recompute_tokens,
        "load_s": round(plan.load_s, 9),
        "pull_s": round(plan.pull_s, 9),
        "recompute_s": round(plan.recompute_s, 9),
    }


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
        pull_margin: float = DEFAULT_PULL_MARGIN,
    ) -> None:
        self.profile, self.pool, self.index, self.tracker = profile, pool, index, tracker
        self.block_size, self.salt_model = block_size, salt_model
        self.pull_margin = pull_margin  # 0: never hint a pull
        self.pending = PendingPulls()
        self.pd_params: PdParams | None = None  # None: every request aggregated (no P/D)
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
        pd: bool = False,
    ) -> Routed:
        """Picks a worker for `prompt` (uint32 token ids) and the pull it makes, if any. Hashes are salted
        with `make_salt(salt_model, lora, tenant)`: one tenant never matches another's blocks. With `pd` and a
        fleet with prefill workers, the request may be disaggregated (`kvmesh.routing.disagg`); otherwise
        it goes to a worker that decodes (a prefill worker runs prefill halves only)."""
        await self.pool.settle()
        hashes = hashing.compute_block_hashes(prompt, self.block_size, self.salt_of(lora, tenant))
        found = await self.index.lookup(hashes, tenant=tenant, lora=lora, token_ids=prompt)
        t0 = time.perf_counter()
        now = time.monotonic()
        views = self.pool.views(now)
        if exclude:
            views = [v for v in views if v.id not in exclude]
        self.tracker.apply(views)
        rr = self.query(rid, len(prompt), hashes, found, views, now, session, max_tokens)
        if any(v.role is WorkerRole.PREFILL for v in views):
            if pd and self.pd_params is not None:
                pdd = decide_pd(rr, views, self.pd_params)
                record_pd(pdd.disaggregate, pdd.reason)
                if pdd.disaggregate and pdd.prefill_worker and pdd.decode_worker:
                    return self._disaggregated(rr, pdd, views, t0)
            views = [v for v in views if v.role.decodes]
        d = self.profile.decide(rr, views)
        if d.worker_id is None:
            record_decision(rid, d, time.perf_counter() - t0)
            if d.rejected_by == "kv-headroom":
                raise ResourceExhausted("every worker's KV cache is full", retry_after_s=1.0)
            raise Unavailable(f"no worker available (rejected by {d.rejected_by})")
        view = next(v for v in views if v.id == d.worker_id)
        plan = plan_prefix(rr, view, sources_of(rr))
        pull, outcome = self._hint(rr, plan, views, found, now)
        d.prefix = {**plan_terms(plan), "hint": outcome, "hint_blocks": pull.num_blocks if pull else 0}
        record_decision(rid, d, time.perf_counter() - t0)
        record_prefix(plan, outcome)
        log.debug("request %s on %s: %s", rid, d.worker_id, d.prefix)
        overlap = min(plan.covered_blocks * self.block_size, len(prompt))
        record_routed(d.worker_id, len(prompt), overlap)
        return Routed(d.worker_id, overlap, pull)

    def _disaggregated(self, rr: RoutingQuery, pdd: PdDecision, views: list[WorkerView], t0: float) -> Routed:
        """The decode worker and the prefill half of a disaggregated decision."""
        assert pdd.prefill_worker is not None and pdd.decode_worker is not None
        prefill = next(v for v in views if v.id == pdd.prefill_worker)
        handed = max(rr.prompt_tokens - 1, 0) // rr.block_size * rr.block_size  # the last token's block is computed
        n_new = int(pdd.terms.get("uncached_tokens", rr.prompt_tokens))
        d = Decision(rr.request_id, pdd.decode_worker, picker="disagg")
        d.prefix = {"mode": "disaggregated", "prefill": prefill.id, **pdd.terms}
        record_decision(rr.request_id, d, time.perf_counter() - t0)
        log.debug("request %s: prefill on %s, decode on %s: %s", rr.request_id, prefill.id, d.worker_id, d.prefix)
        record_routed(pdd.decode_worker, rr.prompt_tokens, handed)
        return Routed(pdd.decode_worker, handed, None, PrefillHalf(prefill.id, n_new))

    def query(
        self,
        rid: str,
        n_prompt: int,
        hashes: np.ndarray,
        found: PrefixMatches,
        views: list[WorkerView],
        now: float,
        session: str = "",
        max_tokens: int = 256,
    ) -> RoutingQuery:
        """The routing query of the module docstring: GPU runs, GPU + tier (+ pending pulls), pull sources."""
        tier = dict(found.total)
        for v in views:
            p = self._pending(v.id, hashes, found, now)
            if p is not None:
                tier[v.id] = p.blocks
        sources = {v.id: found.total[v.id] for v in views if v.id in found.total and _serves_pulls(v)}
        return RoutingQuery(
            rid,
            n_prompt,
            hashes,
            found.gpu,
            self.block_size,
            session_id=session,
            max_tokens=max_tokens,
            tier_matches=tier,
            peer_pulls=self.pull_margin > 0,
            pull_sources=sources,
            pull_margin=self.pull_margin,
        )

    def _pending(self, wid: str, hashes: np.ndarray, found: PrefixMatches, now: float) -> PendingPull | None:
        """A pull hinted to `wid` of a prefix of `hashes` whose blocks the index does not show there yet."""
        p = self.pending.covering(wid, hashes, now)
        return p if p is not None and found.total.get(wid, 0) < p.blocks else None

    def _hint(
        self, rr: RoutingQuery, plan: PrefixPlan, views: list[WorkerView], found: PrefixMatches, now: float
    ) -> tuple[KvPull | None, str]:
        """(hint, "sent") for the plan's pull; (the running pull's hint, "joined") when the plan counts on a
        pull already hinted to the worker; (None, "") otherwise."""
        by_id = {v.id: v for v in views}
        cap = max(0, (rr.prompt_tokens - 1) // rr.block_size)
        blocks = min(plan.covered_blocks, cap)
        hashes = np.asarray(rr.block_hashes, dtype=np.uint64)
        pending = self._pending(plan.worker, hashes, found, now)
        src = by_id.get(plan.source or "")
        new = plan.pull_blocks and src is not None and blocks > plan.gpu_blocks + plan.load_blocks
        if new and src is not None and (pending is None or blocks > pending.blocks):
            unix_ms = int(time.time() * 1000) + PULL_HINT_TTL_MS
            pull = PendingPull(src.id, blocks, now + PULL_HINT_TTL_MS / 1000, unix_ms)
            self.pending.add(plan.worker, int(hashes[blocks - 1]), pull)
            return self._hint_msg(src, blocks, unix_ms), "sent"
        if pending is not None and blocks >= pending.blocks:
            src = by_id.get(pending.source)
            if src is not None and src.kvsync_address:
                return self._hint_msg(src, pending.blocks, pending.expires_unix_ms), "joined"
        return None, ""

    @staticmethod
    def _hint_msg(src: WorkerView, blocks: int, expires_unix_ms: int) -> KvPull:
        """The pull of the prompt's `blocks` leading blocks from `src`, void at `expires_unix_ms`."""
        return KvPull(
            source_address=src.kvsync_address,
            region=src.tier_region,
            num_blocks=blocks,
            source_worker_id=src.id,
            shm_name=src.tier_shm_name,
            expires_unix_ms=expires_unix_ms,
        )
