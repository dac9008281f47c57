"""KV tiers below a simulated worker's GPU pool: CPU memory and, optionally, a disk (pure; time is an argument).

Blocks the GPU pool evicts are saved to the CPU tier; blocks the CPU tier evicts go to the disk tier (if
any), and out of the worker when the last tier evicts them. Each tier keeps at most ``capacity`` blocks and
evicts by the hybrid LFU+LRU score used elsewhere in kvmesh (LRFU, ``kvmesh.ops.warming.policy``): a block's
score is Σ 2^(−(now − t_i)/h) over its accesses t_i (saves and loads). Scores decay at the same rate, so
their order never changes between accesses and a block's rank is the constant key

    key = log2(score at t_last) + t_last / h

kept in a heap (stale entries skipped lazily). A load back into the GPU pool keeps the tier copy (the tier is
inclusive, as LMCache's and KVBM's CPU caches are) and counts as an access.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.engine.sim.perf import (
    H200_LLAMA70B_FP8,
    H200_NODE_LINKS,
    LinkModel,
    PerfModel,
    tier_blocks,
    transfer_figures,
)
from kvmesh.routing.dataplane import DEFAULT_PULL_MARGIN, transfer_costs
from kvmesh.routing.types import TransferCosts

DEFAULT_HALF_LIFE_S = 120.0


class KvTier:
    """One tier of one worker: block hash → LRFU score under ``capacity`` blocks."""

    def __init__(self, capacity: int, half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        if capacity < 0 or half_life_s <= 0:
            raise ValueError("capacity must be >= 0 and half_life_s > 0")
        self.capacity = capacity
        self.h = half_life_s
        self._key: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._key

    def _access(self, block_hash: int, now: float) -> None:
        old = self._key.get(block_hash)
        # score(now) = old score decayed to now + 1, in the log domain: key = log2(score(now)) + now/h
        score = 1.0 if old is None else 2.0 ** (old - now / self.h) + 1.0
        key = math.log2(score) + now / self.h
        self._key[block_hash] = key
        heapq.heappush(self._heap, (key, block_hash))
        if len(self._heap) > 4 * len(self._key) + 64:  # bound the stale entries
            self._heap = [(k, b) for b, k in self._key.items()]
            heapq.heapify(self._heap)

    def touch(self, block_hash: int, now: float) -> None:
        """An access to a resident block (a load from this tier); no-op if absent."""
        if block_hash in self._key:
            self._access(block_hash, now)

    def save(self, block_hash: int, now: float) -> list[int]:
        """Store (or touch) a block; returns the blocks evicted to stay within capacity (lowest score first)."""
        if self.capacity == 0:
            return [block_hash]
        self._access(block_hash, now)
        out: list[int] = []
        while len(self._key) > self.capacity:
            key, b = heapq.heappop(self._heap)
            if self._key.get(b) == key:
                del self._key[b]
                out.append(b)
        return out

    def clear(self) -> None:
        self._key.clear()
        self._heap.clear()


@dataclass(frozen=True, slots=True)
class TierSpec:
    """Capacities of one worker's tiers, in blocks."""

    cpu_blocks: int
    disk_blocks: int = 0
    half_life_s: float = DEFAULT_HALF_LIFE_S


@dataclass(frozen=True, slots=True)
class DataPlane:
    """The fleet's KV data plane: tier sizes per worker (GB = 10⁹ B), link figures, the pull margin.

    Every policy's workers get the tiers (Dynamo's KVBM and LMCache give theirs one); only a policy whose
    ``peer_pulls`` is set (kvmesh) routes on tier contents and pulls from peers.
    """

    cpu_tier_gb: float = 256.0
    disk_tier_gb: float = 0.0
    links: LinkModel = H200_NODE_LINKS
    pull_margin: float = DEFAULT_PULL_MARGIN
    half_life_s: float = DEFAULT_HALF_LIFE_S

    def spec(self, block_size: int, model: PerfModel = H200_LLAMA70B_FP8) -> TierSpec:
        """Tier capacities in blocks of ``block_size`` tokens (``kvmesh.engine.sim.perf.tier_blocks``)."""
        return TierSpec(
            tier_blocks(self.cpu_tier_gb, block_size, model),
            tier_blocks(self.disk_tier_gb, block_size, model),
            self.half_life_s,
        )

    def transfer_costs(self, block_size: int, model: PerfModel = H200_LLAMA70B_FP8) -> TransferCosts:
        """Per-block link times and the prefill time per token, in seconds (`dataplane.transfer_costs`)."""
        return transfer_costs(block_size, transfer_figures(model, self.links))


class WorkerTiers:
    """The CPU tier and optional disk tier of one worker (see the module docstring)."""

    def __init__(self, spec: TierSpec) -> None:
        self.cpu = KvTier(spec.cpu_blocks, spec.half_life_s)
        self.disk = KvTier(spec.disk_blocks, spec.half_life_s) if spec.disk_blocks > 0 else None
        self.saved = 0
        self.dropped = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.cpu or (self.disk is not None and block_hash in self.disk)

    def medium(self, block_hash: int) -> str | None:
        """ "cpu", "disk" or None: where the block is (the CPU copy wins)."""
        if block_hash in self.cpu:
            return "cpu"
        if self.disk is not None and block_hash in self.disk:
            return "disk"
        return None

    def save_evicted(self, hashes: Iterable[int], now: float) -> list[int]:
        """Save blocks the GPU pool evicted; returns the blocks that left the worker altogether."""
        gone: list[int] = []
        for h in hashes:
            self.saved += 1
            for b in self.cpu.save(h, now):
                if self.disk is None:
                    gone.append(b)
                else:
                    gone.extend(self.disk.save(b, now))
        gone = [b for b in gone if b not in self]
        self.dropped += len(gone)
        return gone

    def touch(self, block_hash: int, now: float) -> None:
        self.cpu.touch(block_hash, now)
        if self.disk is not None:
            self.disk.touch(block_hash, now)
