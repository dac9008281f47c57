"""The own tier's KV events: vLLM `BlockStored` / `BlockRemoved` with medium "CPU", under vLLM's own names.

vLLM's events describe only its GPU pool. A block the connector puts in its tier (computed, or pulled from a
peer) is announced as `BlockStored(medium="CPU")` with the *same* block hash, parent hash, token ids,
LoRA name and `extra_keys` as vLLM's GPU event for it, so an index that chains engine hashes (kvmesh's
cache-manager) counts it as a second copy of the same block; a block the tier evicts is announced as
`BlockRemoved(medium="CPU")`. Once vLLM's pool drops its copy, the block is held only in the tier.

- Scheduler side: `block_key` names block `index` of a request as vLLM's `BlockPool.cache_full_blocks`
  does; the key rides to the worker side in the `SaveOp` / `LoadOp` that puts the block in the tier.
- Worker side: `TierEventLog` records what the tier really did (a put of a digest it did not hold, the
  digests `TierRegion.drain_evicted` reports) and keeps digest -> vLLM hash only for blocks in the tier
  (at most one entry per slot). Its events go back in the step's `KVConnectorOutput` (`KvmeshKVEvents`)
  and the scheduler side returns them from `take_events()`: vLLM appends them to the `KVEventBatch` it
  publishes after its own, so a block's GPU `BlockStored` always precedes its CPU one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
    resolve_block_hashes,
    to_event_extra_keys,
)

from kvmesh.kvplane.vllm_connector.plan import BlockKey

if TYPE_CHECKING:
    from vllm.v1.request import Request

KV_GROUP = 0  # the connector stores the attention group's blocks (hybrid models are not supported)


def block_key(request: Request, index: int, block_size: int, hash_block_size: int) -> BlockKey | None:
    """Block `index` of `request` as vLLM's KV events name it, or None while vLLM has no hash for it."""
    hashes = resolve_block_hashes(request.block_hashes, hash_block_size, block_size)
    if index >= len(hashes):
        return None
    start = index * block_size
    extra, _ = generate_block_hash_extra_keys(request, start, start + block_size, 0)
    keys = to_event_extra_keys([extra])
    lora = request.lora_request
    return BlockKey(
        block_hash=maybe_convert_block_hash(hashes[index]),
        parent_hash=maybe_convert_block_hash(hashes[index - 1]) if index else None,
        token_ids=tuple(request.all_token_ids[start : start + block_size]),
        extra_keys=keys[0] if keys else None,
        lora_name=lora.lora_name if lora is not None else None,
        lora_id=lora.adapter_id if lora is not None else None,
    )


@dataclass
class _Run:
    """Consecutive blocks of one chain stored in the tier: one `BlockStored`."""

    first: BlockKey
    hashes: list[Any] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    extra: list[tuple[Any, ...] | None] = field(default_factory=list)

    def extends(self, key: BlockKey) -> bool:
        return key.parent_hash == self.hashes[-1] and key.lora_name == self.first.lora_name

    def add(self, key: BlockKey) -> None:
        self.hashes.append(key.block_hash)
        self.tokens.extend(key.token_ids)
        self.extra.append(key.extra_keys)

    def event(self, block_size: int) -> BlockStored:
        return BlockStored(
            block_hashes=self.hashes,
            parent_block_hash=self.first.parent_hash,
            token_ids=self.tokens,
            block_size=block_size,
            lora_id=self.first.lora_id,
            medium=MEDIUM_CPU,
            lora_name=self.first.lora_name,
            extra_keys=self.extra if any(k is not None for k in self.extra) else None,
            group_idx=KV_GROUP,
        )


class TierEventLog:
    """Worker side: the tier's stores and evictions since the last `take()`, as vLLM events in order."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._hashes: dict[bytes, Any] = {}  # digest -> vLLM hash, for the tier's blocks that have a key
        self._pending: list[_Run | BlockRemoved] = []

    def __len__(self) -> int:
        return len(self._hashes)

    def stored(self, digest: bytes, key: BlockKey | None) -> None:
        """The tier now holds `digest` (it did not before); a block without a key is not announced."""
        if key is None:
            return
        self._hashes[digest] = key.block_hash
        last = self._pending[-1] if self._pending else None
        if not isinstance(last, _Run) or not last.extends(key):
            last = _Run(key)
            self._pending.append(last)
        last.add(key)

    def evicted(self, digests: list[bytes]) -> None:
        """The tier dropped these digests (announced only if their store was)."""
        gone = [h for d in digests if (h := self._hashes.pop(d, None)) is not None]
        if gone:
            self._pending.append(BlockRemoved(block_hashes=gone, medium=MEDIUM_CPU, group_idx=KV_GROUP))

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        out: list[KVCacheEvent] = [e.event(self.block_size) if isinstance(e, _Run) else e for e in self._pending]
        self._pending = []
        return out


class KvmeshKVEvents(KVConnectorKVEvents):
    """The tier's events of one step in `KVConnectorOutput.kv_cache_events`. Kept in order (vLLM's
    `KVEventAggregator` counts events in a multiset, which would reorder a store, evict, store of one block):
    the connector runs one worker (tensor parallelism is off), so there is nothing to reconcile."""

    def __init__(self, events: list[KVCacheEvent] | None = None, workers: int = 1) -> None:
        self._events = list(events or [])
        self._workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> KvmeshKVEvents:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events.clear()
