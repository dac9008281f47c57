"""ZMQ ingestion of a stock vLLM server's KV events (`--kv-events-config`), with replay on gaps.

A SUB socket follows the publisher; every batch goes to an `IngestSink` (the ingestion state machine,
usually wrapped by the service to log and fan out). When the sink asks for a replay from sequence s,
a DEALER socket sends `[b"", s as 8-byte big-endian]` to vLLM's replay ROUTER, which answers with
`[b"", topic, seq, payload]` frames for every buffered batch ≥ s and ends with `[b"", b"", -1, b""]`.
If the replay does not close the gap (vLLM's buffer no longer has it), the sink is told
`replay_failed` and, when configured, `on_unrecoverable` is awaited (e.g. a POST to vLLM's
`/reset_prefix_cache` in dev mode: the resulting `AllBlocksCleared` is a resync point). Every wait is
bounded by `replay_timeout_s`; the loop ends when `stop` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import zmq
import zmq.asyncio

from kvmesh.cachemgr.types import IngestResult
from kvmesh.cachemgr.vllm_wire import VllmTranslator
from kvmesh.kvevents import KvEventBatch

log = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class IngestSink(Protocol):
    """Where batches go (`kvmesh.cachemgr.ingest.Ingestor` satisfies it)."""

    def apply(self, batch: KvEventBatch) -> IngestResult: ...

    def replay_failed(self, worker_id: str, reason: str = ...) -> IngestResult: ...

    def is_replaying(self, worker_id: str) -> bool: ...


class VllmZmqSubscriber:
    """Follows one vLLM publisher (see module docstring)."""

    def __init__(
        self,
        worker_id: str,
        endpoint: str,
        replay_endpoint: str | None,
        sink: IngestSink,
        topic: str = "",
        translator: VllmTranslator | None = None,
        replay_timeout_s: float = 5.0,
        on_unrecoverable: Callable[[str], Awaitable[None]] | None = None,
        ctx: zmq.asyncio.Context | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.sink = sink
        self.topic = topic.encode()
        self.tr = translator or VllmTranslator(worker_id)
        self.replay_timeout_s = replay_timeout_s
        self.on_unrecoverable = on_unrecoverable
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.received = 0
        self.replays = 0
        self.replay_failures = 0
        self.progress = asyncio.Event()  # set after every live batch handled (tests and readiness)

    async def run(self, stop: asyncio.Event) -> None:
        """Receive until `stop` is set."""
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        stopper = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                recv = asyncio.ensure_future(sub.recv_multipart())
                done, _ = await asyncio.wait({recv, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if recv not in done:
                    recv.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await recv
                    break
                frames = recv.result()
                if len(frames) != 3:
                    log.warning("vLLM %s: malformed frame (%d parts)", self.worker_id, len(frames))
                    continue
                await self._handle(self.tr.decode(frames[1], frames[2], live=True))
                self.received += 1
                self.progress.set()
        finally:
            stopper.cancel()
            sub.close(linger=0)

    async def _handle(self, batch: KvEventBatch) -> None:
        res = self.sink.apply(batch)
        if res.resync is not None and not res.resync.full_dump:
            await self.replay(res.resync.from_sequence)

    async def replay(self, start: int) -> None:
        """Ask vLLM for every buffered batch ≥ `start`; escalate if the gap stays open."""
        self.replays += 1
        if self.replay_endpoint is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._replay_once(start), self.replay_timeout_s)
        if self.sink.is_replaying(self.worker_id):
            self.replay_failures += 1
            self.sink.replay_failed(self.worker_id, f"vLLM replay from {start} did not close the gap")
            if self.on_unrecoverable is not None:
                await self.on_unrecoverable(self.worker_id)

    async def _replay_once(self, start: int) -> None:
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            for _ in range(1 << 20):  # vLLM buffers at most `buffer_steps` batches
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return
                res = self.sink.apply(self.tr.decode(frames[2], frames[3], live=False))
                if res.resync is not None and res.resync.full_dump:
                    return
        finally:
            dealer.close(linger=0)
