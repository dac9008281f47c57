"""`VllmPulls`: the vLLM engine's side of a peer pull (`VllmEngine.pull_prefix`), one lease per request.

On a vLLM worker the blocks are loaded by kvmesh's KV connector in vLLM's engine-core process, which reads
shared memory one-sided and never waits on the network. So the pull is arranged here, on the worker's event
loop, before vLLM sees the request, and its outcome's `load` is the leased pull `generate` hands the
connector (`kvmesh.kvplane.vllm_connector.plan.pull_params`): a lease on a same-host source's region, or,
for a source on another host, blocks streamed over gRPC into this worker's `PullStaging` region and leased
there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

from kvmesh.core.generation import EngineRequest
from kvmesh.core.pull import KvPull, PullOutcome
from kvmesh.kvplane.kvsync.client import Lease, PullFailed, PullStats
from kvmesh.kvplane.kvsync.service import MAX_BLOCKS
from kvmesh.kvplane.pulls import TIER_REGION, PeerPulls, leased_prefix, leased_pull, region_on_host
from kvmesh.kvplane.staging import PullStaging
from kvmesh.kvplane.vllm_connector.layout import KvLayout, block_digests

if TYPE_CHECKING:
    from kvmesh.engine.vllm_engine import VllmEngine

log = logging.getLogger(__name__)
STREAM_MARGIN_S = 0.05  # a staging stream ends this long before the pull's deadline, to stage what it got


class VllmPulls:
    """A vLLM worker's pulls -> leased pulls for kvmesh's connector, one lease per request.

    Same host (the pull's region attaches here and `limits.over_shm`): one `AcquireLease` on the source's
    KvSyncService, and the connector reads the leased blocks one-sided from the source's shared memory.
    Otherwise (another host, or `over_shm` false): the blocks are streamed over gRPC (`ReadBlocks`, each
    CRC32C-verified) within the pull's deadline into `staging`, leased there, and the connector reads them
    from the staging region.

    Any failure (dead peer, timeout, corrupt block, nothing held, an expired pull) means no pull: the request
    is computed. A stream that fails part-way keeps its leading verified blocks (`PullFailed.delivered`):
    those are staged and leased, the rest is computed by vLLM, and no block after the first failed one is
    used. Outcomes (`leased`, `remote`, `remote_partial`, `missing`, `failed`, `expired`,
    `remote_unsupported` when staging is off) are counted in `outcomes`.
    """

    def __init__(
        self, engine: VllmEngine, peers: PeerPulls, staging: PullStaging, layout: KvLayout | None = None
    ) -> None:
        self.engine = engine
        self.peers = peers
        self.staging = staging
        self.outcomes: Counter[str] = Counter()
        self._kv_layout = layout

    def warm(self) -> None:
        """The KV layout (its import of vLLM's connector API takes seconds) and the staging region, before the
        worker serves: the first pull's deadline must not pay for them."""
        layout = self._layout()
        if self.staging.enabled:
            self.staging.open(layout)

    async def arrange(self, req: EngineRequest, pull: KvPull) -> PullOutcome:
        """The leased pull the connector loads the request's leading blocks by (`load` None: no pull)."""
        if pull.expired(time.time() * 1000):
            return self._outcome("expired")
        limits = self.peers.limits
        same_host = limits.over_shm and bool(pull.shm_name) and region_on_host(pull.shm_name)
        if not same_host and not self.staging.enabled:
            return self._outcome("remote_unsupported")
        timeout_s = limits.timeout_ms_of(pull) / 1000.0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                limit = min(pull.num_blocks or MAX_BLOCKS, MAX_BLOCKS)  # the pull's prefix, one call
                digests = (list(pull.digests) or await self.digests(req))[:limit]
                if not digests:
                    return self._outcome("missing")
                if same_host:
                    return self._leased(pull.shm_name, await self._lease(pull, digests, timeout_s))
                # the stream's own deadline comes first, so its verified prefix is kept (a cancel keeps none)
                left = max(0.001, deadline - loop.time() - STREAM_MARGIN_S)
                return self._staged(*await self._pull_into_staging(pull, digests, left))
        except Exception as e:  # any failure is a recompute, never an error of the request
            log.warning("pull from %s failed, computing instead: %s", pull.source_address, e)
            return self._outcome("failed")

    async def _lease(self, pull: KvPull, digests: list[bytes], timeout_s: float) -> Lease:
        return await self.peers.client(pull.source_address).acquire_lease(
            pull.region or TIER_REGION, digests, ttl_ms=self.peers.limits.lease_ms_of(pull), timeout_s=timeout_s
        )

    async def _pull_into_staging(
        self, pull: KvPull, digests: list[bytes], timeout_s: float
    ) -> tuple[list[bytes], int, bool]:
        """Streams the leading held blocks of `digests` from the source over gRPC (one ReadBlocks, leasing by
        digest there) straight into reserved staging slots, then publishes and leases the leading verified
        ones; returns (the staged digests, their lease's end, whether the stream failed part-way)."""
        layout = self._layout()
        self.staging.open(layout)
        lease_ms = self.peers.limits.lease_ms_of(pull)
        plan = self.staging.reserve(digests, time.monotonic_ns() + lease_ms * 1_000_000)
        if not plan.digests:  # every staging slot is leased: nothing to pull into
            return [], 0, False
        delivered, partial = PullStats("grpc"), False
        try:
            # under the pull's carried lease when it fits (a replicated prefix's), else leasing there
            delivered = await self.peers.pull(
                pull,
                plan.digests,
                plan.outs,
                layout.describe(),
                timeout_s,
                prefer_shm=False,  # the shared-memory case is the same-host lease above
            )
        except PullFailed as e:
            if not e.blocks:
                raise
            delivered, partial = e.delivered, True
            log.info(
                "pull from %s failed after %d verified blocks, staging those: %s", pull.source_address, e.blocks, e
            )
        finally:  # on any exit, a cancellation too: publish only the verified prefix, free every other slot
            until_ns = time.monotonic_ns() + lease_ms * 1_000_000
            staged = self.staging.commit(plan, delivered, until_ns)
        log.info(
            "pulled %d blocks (%d B) from %s over %s into staging",
            len(staged),
            delivered.bytes,
            pull.source_address,
            delivered.transport,
        )
        return staged, until_ns, partial

    def _leased(self, shm_name: str, lease: Lease) -> PullOutcome:
        load = leased_pull(shm_name, lease.lease_until_ns, leased_prefix(lease))
        return self._outcome("leased" if load else "missing", load)

    def _staged(self, digests: list[bytes], until_ns: int, partial: bool) -> PullOutcome:
        assert self.staging.region is not None
        load = leased_pull(self.staging.region.shm_name, until_ns, digests)
        outcome = ("remote_partial" if partial else "remote") if load else "missing"
        return self._outcome(outcome, load)

    async def digests(self, req: EngineRequest) -> list[bytes]:
        """The prompt's block identities as the connector computes them (pulls without digests)."""
        ids = list(req.prompt_token_ids) if req.prompt_token_ids is not None else None
        if ids is None:
            ids = await self.engine.tokenize(req.prompt or "")
        return block_digests(ids, self._layout(), req.lora_name, req.tenant)

    def _layout(self) -> KvLayout:
        if self._kv_layout is None:  # the front end's config: the same model, dtype and block size as the core's
            self._kv_layout = self.engine.kv_layout()
        return self._kv_layout

    def _outcome(self, outcome: str, load: KvPull | None = None) -> PullOutcome:
        self.outcomes[outcome] += 1
        return PullOutcome(outcome, load.num_blocks if load is not None else 0, load)

    def close(self) -> None:
        """Unlinks the staging region."""
        self.staging.close()
