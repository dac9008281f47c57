"""Proto ⇄ domain conversions of the cache-manager."""

from __future__ import annotations

from kvmesh.cachemgr.types import Cleared, IndexDelta, Removed, Stored
from kvmesh.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch
from kvmesh.v1 import cache_manager_pb2, common_pb2


def event_from_proto(e: common_pb2.KvEvent) -> KvEvent | None:
    """One proto event → domain (None for an empty oneof)."""
    which = e.WhichOneof("event")
    if which == "block_stored":
        s = e.block_stored
        parent = s.parent_block_hash if s.HasField("parent_block_hash") else None
        return BlockStored(
            tuple(s.block_hashes),
            parent,
            tuple(s.token_ids),
            s.block_size,
            s.lora_name or None,
            s.medium or None,
            s.tenant or None,
        )
    if which == "block_removed":
        return BlockRemoved(tuple(e.block_removed.block_hashes), e.block_removed.medium or None)
    if which == "all_blocks_cleared":
        return AllBlocksCleared()
    return None


def events_from_proto(b: common_pb2.KvEventBatch) -> tuple[KvEvent, ...]:
    return tuple(ev for e in b.events if (ev := event_from_proto(e)) is not None)


def batch_from_proto(b: common_pb2.KvEventBatch, worker_id: str, instance_id: str) -> KvEventBatch:
    """Proto batch → domain; the stream's hello fills a missing worker/instance id."""
    return KvEventBatch(
        b.worker_id or worker_id, b.instance_id or instance_id, b.sequence, b.timestamp, events_from_proto(b), b.dp_rank
    )


def delta_to_proto(d: IndexDelta) -> cache_manager_pb2.IndexDelta:
    """Domain delta → proto."""
    if isinstance(d, Stored):
        msg = cache_manager_pb2.IndexDelta(worker_id=d.worker, stored=list(d.hashes))
        if d.parent is not None:
            msg.parent = d.parent
        return msg
    if isinstance(d, Removed):
        return cache_manager_pb2.IndexDelta(worker_id=d.worker, removed=list(d.hashes))
    assert isinstance(d, Cleared)
    return cache_manager_pb2.IndexDelta(worker_id=d.worker, cleared=True)
