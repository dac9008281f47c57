"""KV events in vLLM's ZMQ wire format, so any vLLM-compatible consumer can follow a kvmesh worker.

Frames: `[topic, sequence (8-byte big-endian), payload]` on a PUB socket, the payload encoded by
`kvmesh.wire.vllm_events.encode_payload` (vLLM's `KVEventBatch` layout). Replay: a ROUTER socket
answers a DEALER's `[b"", start_seq (8 bytes)]` with every buffered `[b"", topic, seq, payload]` from
start_seq on, then `[b"", b"", -1 (8 bytes, signed), b""]`, exactly as vLLM's `ZmqEventPublisher` does.
The replay buffer keeps the newest `buffer` batches holding at most `buffer_bytes` of payload in all: a
batch's size follows its prompts, so a count alone bounds nothing in bytes (the same rule as the gRPC
replay's, `kvlog`); a consumer that asks for older batches gets what is left and sees the gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import zmq
import zmq.asyncio

from kvmesh.core.kvevents import KvEventBatch
from kvmesh.core.tasks import stop_task
from kvmesh.wire.vllm_events import END_SEQ, decode_seq, encode_payload, encode_seq

log = logging.getLogger(__name__)

DEFAULT_BUFFER_BYTES = 8 << 20  # ~50k blocks' events: minutes of a busy worker's history


class ZmqKvPublisher:
    """PUB (+ optional ROUTER replay) on the given endpoints; `publish(batch)` never blocks."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str = "",
        topic: str = "kv-events",
        buffer: int = 10_000,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    ):
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self._buffer_bytes = buffer_bytes
        self.buffered_bytes = 0  # payload bytes in the replay buffer (at most buffer_bytes)
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint = ""
        self._task: asyncio.Task[None] | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.create_task(self._serve_replay(), name="zmq-kv-replay")

    def publish(self, batch: KvEventBatch) -> None:
        payload = encode_payload(batch)
        seq = encode_seq(batch.sequence)
        if self._buffer and len(self._buffer) == self._buffer.maxlen:
            self.buffered_bytes -= len(self._buffer[0][1])  # the deque drops it on append
        self._buffer.append((batch.sequence, payload))
        self.buffered_bytes += len(payload)
        while self._buffer and self.buffered_bytes > self._buffer_bytes:
            self.buffered_bytes -= len(self._buffer.popleft()[1])
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
            start = decode_seq(start_b)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await self._replay.send_multipart((client, b"", self._topic, encode_seq(seq), payload))
            await self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._task is not None:
            await stop_task(self._task)
        self._ctx.destroy(linger=0)
