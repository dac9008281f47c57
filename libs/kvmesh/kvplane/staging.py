"""The staging region of a worker that pulls from peers on other hosts for a KV connector: blocks streamed
over gRPC land straight in its slots, and the connector reads them one-sided, as from a same-host peer."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.kvplane.kvsync import mooncake
from kvmesh.kvplane.kvsync.client import PullStats
from kvmesh.kvplane.kvsync.tier import Reservation, SlotRef, TierRegion, region_name
from kvmesh.kvplane.vllm_connector.layout import KvLayout

log = logging.getLogger(__name__)
STAGING_TAG = "pull-staging"  # the staging region is kvmesh-<pid>-pull-staging (orphans are found by pid)


@dataclass
class StagingPlan:
    """Where one pull's blocks land in the staging region, in digest order: a `Reservation` (the client's
    receive copy writes straight into the slot) or, for a digest already staged, its held slot (leased at
    once, so this pull's reservations cannot evict it) with a scratch buffer for the bytes the stream brings."""

    digests: list[bytes] = field(default_factory=list)
    outs: list[memoryview] = field(default_factory=list)
    slots: list[Reservation | SlotRef] = field(default_factory=list)


class PullStaging:
    """A vLLM worker's staging region for cross-host pulls (a kv-sync `TierRegion` this process owns).

    `reserve` takes a slot per block before the stream (`TierRegion.reserve`: generation odd, unseen by
    readers); `KvSyncClient.pull` assembles each block straight into its slot, the CRC32C computed in that
    copy's pass; `commit` publishes the leading verified blocks with those CRCs (no second copy, no second
    checksum) and leases them, so the connector reads them one-sided like a same-host peer's region and no
    later pull evicts them before the lease ends; every other reservation is aborted. Slots =
    `capacity_bytes // block_bytes` (at least 1); created on first use (the block size is the engine's
    layout), unlinked by `close`.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.region: TierRegion | None = None
        self._export: mooncake.Export | None = None  # the region registered with this process's Mooncake TE

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def open(self, layout: KvLayout) -> TierRegion:
        if self.region is None:
            slots = max(1, self.capacity_bytes // layout.block_bytes)
            name = region_name(STAGING_TAG)
            self.region = TierRegion.create(name, layout.block_bytes, slots, layout.describe())
            engine = mooncake.running()  # a Mooncake pull then lands straight in the reserved slots
            if engine is not None:
                self._export = engine.register(self.region.segment)
            log.info("pull staging region %s: %d slots of %d B", name, slots, layout.block_bytes)
        return self.region

    def reserve(self, digests: Sequence[bytes], until_ns: int) -> StagingPlan:
        """A slot for each leading digest, in order, until one finds none (every slot leased or reserved);
        digests already staged keep their slot, leased until `until_ns` first."""
        region = self.region
        assert region is not None, "open() first"
        refs = region.locate(digests)
        region.lease([r for r in refs if r is not None], until_ns)
        now = time.monotonic_ns()
        plan = StagingPlan()
        for digest, ref in zip(digests, refs, strict=True):
            slot: Reservation | SlotRef | None = ref if ref is not None else region.reserve(digest, now)
            if slot is None:
                break
            plan.digests.append(digest)
            plan.slots.append(slot)
            plan.outs.append(slot.data if isinstance(slot, Reservation) else memoryview(bytearray(region.block_bytes)))
        return plan

    def commit(self, plan: StagingPlan, delivered: PullStats, until_ns: int) -> list[bytes]:
        """Publishes and leases (until `until_ns`) the plan's first `delivered.blocks` blocks with the CRCs
        their copy computed, aborts every other reservation; returns the digests staged."""
        region = self.region
        assert region is not None
        now = time.monotonic_ns()
        keep = delivered.blocks
        staged: list[bytes] = []
        for i, (digest, slot) in enumerate(zip(plan.digests, plan.slots, strict=True)):
            if i < keep and delivered.lengths[i] == 0:  # an empty block is no block: the prefix ends here
                keep = i
            if isinstance(slot, Reservation):
                if i >= keep:
                    region.abort(slot)
                    continue
                slot = region.publish(slot, delivered.lengths[i], delivered.crcs[i], now)
            if i < keep:
                region.lease([slot], until_ns)
                staged.append(digest)
        region.drain_evicted()  # nobody announces the staging region's evictions
        return staged

    def close(self) -> None:
        if self.region is not None:
            engine = mooncake.running()
            if engine is not None and self._export is not None:
                engine.unregister(self._export)  # before the unmap: no read may reach freed pages
            self._export = None
            self.region.close(unlink=True)
            self.region = None
