"""KV events in vLLM's ZMQ wire format, so any vLLM-compatible consumer can follow a kvmesh worker.

Frames: `[topic, sequence (8-byte big-endian), msgpack [ts, [events...], dp_rank]]` on a PUB socket, the
events encoded like vLLM's tagged msgspec structs (`{"type": "BlockStored", ...}`). Replay: a ROUTER socket
answers a DEALER's `[b"", start_seq (8 bytes)]` with every buffered `[b"", topic, seq, payload]` from
start_seq on, then `[b"", b"", -1 (8 bytes, signed), b""]`, exactly as vLLM's `ZmqEventPublisher` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvmesh.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from kvmesh.tasks import stop_task

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
MASK64 = (1 << 64) - 1


class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class _BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


def extra_keys_of(e: BlockStored) -> list[tuple[Any, ...] | None] | None:
    """Per-block `extra_keys` as vLLM publishes them (untagged): the LoRA name on every block, the cache salt
    (tenant) after it on the block that starts at token 0 (an event without a parent), None when empty."""
    n = len(e.block_hashes)
    base: tuple[Any, ...] = (e.lora_name,) if e.lora_name else ()
    keys: list[tuple[Any, ...] | None] = [base or None] * n
    if e.tenant and e.parent_block_hash is None and n:
        keys[0] = (*base, e.tenant)
    return keys if any(k is not None for k in keys) else None


class _BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def encode_batch(b: KvEventBatch) -> bytes:
    """msgpack payload of one batch in vLLM's `KVEventBatch` layout."""
    events: list[Any] = []
    for e in b.events:
        if isinstance(e, BlockStored):
            parent = None if e.parent_block_hash is None else e.parent_block_hash & MASK64
            events.append(
                _BlockStored(
                    [h & MASK64 for h in e.block_hashes],
                    parent,
                    list(e.token_ids),
                    e.block_size,
                    None,
                    e.medium,
                    e.lora_name,
                    extra_keys_of(e),
                )
            )
        elif isinstance(e, BlockRemoved):
            events.append(_BlockRemoved([h & MASK64 for h in e.block_hashes], e.medium))
        elif isinstance(e, AllBlocksCleared):
            events.append(_AllBlocksCleared())
    return msgspec.msgpack.encode(_Batch(b.timestamp, events, b.dp_rank))


class ZmqKvPublisher:
    """PUB (+ optional ROUTER replay) on the given endpoints; `publish(batch)` never blocks."""

    def __init__(self, endpoint: str, replay_endpoint: str = "", topic: str = "kv-events", buffer: int = 10_000):
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint = ""
        self._task: asyncio.Task[None] | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.create_task(self._serve_replay(), name="zmq-kv-replay")

    def publish(self, batch: KvEventBatch) -> None:
        payload = encode_batch(batch)
        seq = batch.sequence.to_bytes(8, "big")
        self._buffer.append((batch.sequence, payload))
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq, payload), flags=zmq.NOBLOCK)

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid ZMQ replay request with %d frames", len(frames))
                continue
            client, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
        self._ctx.destroy(linger=0)
