"""Compact binary encoding of KV events and of the ingestion log records (msgpack via msgspec).

Event: `[0, engine hashes (u64 LE bytes), parent | None, token ids (u32 LE bytes), block_size, lora,
medium, tenant]` for BlockStored (records written before `tenant` existed have 7 items and decode
with tenant None), `[1, hashes, medium]` for BlockRemoved, `[2]` for AllBlocksCleared. Engine
hashes are taken modulo 2^64 (as ingestion does). A log record is `[kind, worker, …]`, one per input
of the ingestion state machine, so replaying the records in order reproduces its state exactly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch

MASK64 = (1 << 64) - 1
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()

BATCH, DUMP_BEGIN, DUMP_EVENTS, DUMP_END, REMOVE_WORKER, REPLAY_FAILED = range(6)


def _u64(xs: Sequence[int]) -> bytes:
    return np.fromiter((x & MASK64 for x in xs), dtype="<u8", count=len(xs)).tobytes()


def event_to_wire(ev: KvEvent) -> list[Any]:
    """Domain event → msgpack-able list."""
    if isinstance(ev, BlockStored):
        toks = np.asarray(ev.token_ids, dtype="<u4").tobytes()
        parent = None if ev.parent_block_hash is None else ev.parent_block_hash & MASK64
        return [0, _u64(ev.block_hashes), parent, toks, ev.block_size, ev.lora_name, ev.medium, ev.tenant]
    if isinstance(ev, BlockRemoved):
        return [1, _u64(ev.block_hashes), ev.medium]
    return [2]


def event_from_wire(w: list[Any]) -> KvEvent:
    """Inverse of `event_to_wire`."""
    if w[0] == 0:
        hs = tuple(np.frombuffer(w[1], dtype="<u8").tolist())
        toks = tuple(np.frombuffer(w[3], dtype="<u4").tolist())
        return BlockStored(hs, w[2], toks, w[4], w[5], w[6], w[7] if len(w) > 7 else None)
    if w[0] == 1:
        return BlockRemoved(tuple(np.frombuffer(w[1], dtype="<u8").tolist()), w[2])
    return AllBlocksCleared()


def batch_to_wire(b: KvEventBatch) -> list[Any]:
    """Domain batch → msgpack-able list."""
    return [b.worker_id, b.instance_id, b.sequence, b.timestamp, [event_to_wire(e) for e in b.events], b.dp_rank]


def batch_from_wire(w: list[Any]) -> KvEventBatch:
    """Inverse of `batch_to_wire`."""
    return KvEventBatch(w[0], w[1], w[2], w[3], tuple(event_from_wire(e) for e in w[4]), w[5])


@dataclass(frozen=True, slots=True)
class LogRecord:
    """One input of the ingestion state machine."""

    kind: int
    worker_id: str
    batch: KvEventBatch | None = None
    instance_id: str = ""
    events: tuple[KvEvent, ...] = ()
    next_sequence: int = 0
    timestamp: float = -math.inf  # DUMP_BEGIN: when the worker took the dump


def encode_record(r: LogRecord) -> bytes:
    """LogRecord → bytes."""
    if r.kind == BATCH:
        assert r.batch is not None
        return _enc.encode([BATCH, batch_to_wire(r.batch)])
    if r.kind == DUMP_EVENTS:
        return _enc.encode([DUMP_EVENTS, r.worker_id, [event_to_wire(e) for e in r.events]])
    if r.kind == DUMP_BEGIN:
        return _enc.encode([r.kind, r.worker_id, r.instance_id, r.next_sequence, r.timestamp])
    return _enc.encode([r.kind, r.worker_id, r.instance_id, r.next_sequence])


def decode_record(data: bytes) -> LogRecord:
    """Inverse of `encode_record`."""
    w = _dec.decode(data)
    if w[0] == BATCH:
        b = batch_from_wire(w[1])
        return LogRecord(BATCH, b.worker_id, batch=b)
    if w[0] == DUMP_EVENTS:
        return LogRecord(DUMP_EVENTS, w[1], events=tuple(event_from_wire(e) for e in w[2]))
    # DUMP_BEGIN records written before the dump's timestamp was logged have 4 items
    return LogRecord(w[0], w[1], instance_id=w[2], next_sequence=w[3], timestamp=w[4] if len(w) > 4 else -math.inf)


def encode(obj: object) -> bytes:
    """msgpack-encode plain data."""
    return _enc.encode(obj)


def decode(data: bytes) -> Any:
    """msgpack-decode plain data."""
    return _dec.decode(data)
