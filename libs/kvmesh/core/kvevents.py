"""Domain types of the cache path: KV events and load reports, independent of gRPC and of any engine.

An engine (vLLM or simulated) emits `KvEventBatch`es; the worker numbers them per worker
(`sequence`, strictly +1 per batch within one `instance_id`) and ships them to the cache-manager.
`block_hashes` are the *engine's* hashes (opaque, possibly seeded per process); the index derives its
own hashes from `token_ids` (see `kvmesh.index.hashing`), so it never depends on an engine's private seed.
Shapes mirror vLLM's `vllm/distributed/kv_events.py` so translation is one-to-one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# Where a block is stored (`BlockStored.medium`, `BlockRemoved.medium`): the engine's own pool, or a host tier.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"


def medium_of(medium: str | None) -> str:
    """An event's medium, upper-cased; None or "" (an engine that does not say) is its own pool, GPU."""
    return (medium or MEDIUM_GPU).upper()


def is_tier(medium: str | None) -> bool:
    """A host-tier medium (CPU, DISK, ...): anything but the engine's own pool."""
    return medium_of(medium) != MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks newly cached by the engine, in chain order; `token_ids` holds len(block_hashes)*block_size ids.

    `tenant` is the cache salt the blocks were computed under (vLLM's `cache_salt`); it matters for the
    first block of a chain, a child inherits its chain's tenant (it may be None when the parent is set).
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    tenant: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted by the engine (engine hashes only)."""

    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (reset, restart)."""


def cache_salt_of(extra_keys: Sequence[Any] | None, lora_name: str | None) -> str | None:
    """The `cache_salt` in vLLM's untagged per-block event `extra_keys` entry, or None.

    vLLM publishes, per block, `(lora_name?, (mm_id, offset)…, cache_salt?, embeds_digest…)` with the salt
    only on the block that starts at token 0; strings are the LoRA name (first, when `lora_name` is set)
    and the salt, so the salt is the string left after skipping the LoRA name.
    """
    if not extra_keys:
        return None
    strings = [k for k in extra_keys if isinstance(k, str)]
    if lora_name is not None and strings and strings[0] == lora_name:
        strings = strings[1:]
    return strings[0] if strings else None


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One batch of events from one worker. `sequence` increases by exactly 1 per batch per `instance_id`."""

    worker_id: str
    instance_id: str
    sequence: int
    timestamp: float
    events: tuple[KvEvent, ...]
    dp_rank: int = 0


@dataclass(slots=True)
class LoadReport:
    """A worker's load, the inputs of the router's scores. Latencies in milliseconds, usage in [0, 1]."""

    worker_id: str
    running: int = 0
    waiting: int = 0
    max_queue: int = 0
    kv_usage: float = 0.0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    prefill_tokens_queued: int = 0
    decode_tokens_active: int = 0
    decode_latency_p50_ms: float = 0.0
    decode_latency_p95_ms: float = 0.0
    prefix_hit_rate: float = 0.0
    error_rate: float = 0.0
    errors_total: int = 0
    timestamp: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
