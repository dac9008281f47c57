"""The one ZMQ follower of a vLLM-format KV-event publisher (vLLM's `ZmqEventPublisher`, or a kvmesh worker's
`--zmq-publish`), with replay on gaps.

A SUB socket follows the publisher; every frame is decoded (`VllmTranslator`) and handed to a `BatchSink`,
which owns the sequence bookkeeping (the cache-manager's ingestion state machine, or the vLLM engine
adapter's in-order gate) and answers with a resync request when the batch reveals a gap. For a replay from
sequence s, a DEALER socket sends `[b"", s as 8-byte big-endian]` to the publisher's replay ROUTER, which
answers with `[b"", topic, seq, payload]` frames for every buffered batch ≥ s and ends with
`[b"", b"", -1, b""]`; every replayed batch goes to the sink too. If the replay does not close the gap (the
buffer no longer has it), the sink is told `replay_failed` and, when configured, `on_unrecoverable` is
awaited (e.g. a prefix-cache reset: the resulting `AllBlocksCleared` is a resync point). Every replay is
bounded by `replay_timeout_s`; `run` ends when `stop` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import zmq
import zmq.asyncio

from kvmesh.core.kvevents import KvEventBatch
from kvmesh.wire.vllm_events import END_SEQ, VllmTranslator, encode_seq

log = logging.getLogger(__name__)
MAX_REPLAY_FRAMES = 1 << 20  # a publisher buffers at most `buffer_steps` batches


class Resync(Protocol):
    """What the sink needs: a replay from `from_sequence`, or (`full_dump`) more than a replay can give."""

    @property
    def from_sequence(self) -> int: ...

    @property
    def full_dump(self) -> bool: ...


class Applied(Protocol):
    """The sink's answer to one batch (`kvmesh.index.types.IngestResult` satisfies it)."""

    @property
    def resync(self) -> Resync | None: ...


class BatchSink(Protocol):
    """Where batches go (`kvmesh.cachemgr.ingest.Ingestor` satisfies it)."""

    def apply(self, batch: KvEventBatch) -> Applied: ...

    def replay_failed(self, worker_id: str, reason: str = ...) -> object: ...

    def is_replaying(self, worker_id: str) -> bool: ...


class VllmZmqSubscriber:
    """Follows one vLLM-format publisher (see module docstring)."""

    def __init__(
        self,
        worker_id: str,
        endpoint: str,
        replay_endpoint: str | None,
        sink: BatchSink,
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
        """Ask the publisher for every buffered batch ≥ `start`; escalate if the gap stays open."""
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
            await dealer.send_multipart([b"", encode_seq(start)])
            for _ in range(MAX_REPLAY_FRAMES):
                frames = await dealer.recv_multipart()
                if len(frames) != 4 or frames[2] == END_SEQ:
                    return
                res = self.sink.apply(self.tr.decode(frames[2], frames[3], live=False))
                if res.resync is not None and res.resync.full_dump:
                    return
        finally:
            dealer.close(linger=0)
