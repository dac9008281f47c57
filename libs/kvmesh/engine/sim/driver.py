"""`SimEngine`: the async driver that runs a `SimEngineCore` under a clock (real, N x faster, virtual).

Loop: while the core has work, `res = core.step(clock.now())`, `await clock.sleep(res.duration_s)`, then
deliver `res.outputs` to their streams and `res.kv_events` to every subscriber. Idle: wait for a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence

from kvmesh.engine.base import EngineOutput, EngineRequest, KvBlockData
from kvmesh.engine.clock import Clock, RealClock
from kvmesh.engine.sim.core import SimConfig, SimEngineCore
from kvmesh.engine.tokenizer import ByteTokenizer, Tokenizer
from kvmesh.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvmesh.kvevents import BlockStored, KvEvent, LoadReport


class _Subscriber:
    def __init__(self, limit: int) -> None:
        self.queue: asyncio.Queue[list[KvEvent]] = asyncio.Queue(maxsize=limit)
        self.lost = False


class SimEngine:
    """Implements `kvmesh.engine.base.Engine` over the simulated core."""

    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        worker_id: str = "sim",
        model_name: str = "sim-llama-3.1-70b-fp8",
        clock: Clock | None = None,
        tokenizer: Tokenizer | None = None,
        event_queue_limit: int = 10_000,
    ) -> None:
        self.core = SimEngineCore(config, worker_id=worker_id)
        self.clock: Clock = clock or RealClock()
        self.tokenizer: Tokenizer = tokenizer or ByteTokenizer()
        self._model_name = model_name
        self._streams: dict[str, asyncio.Queue[EngineOutput]] = {}
        self._subs: list[_Subscriber] = []
        self._event_queue_limit = event_queue_limit
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def block_size(self) -> int:
        return self.core.config.block_size

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self.core.config.max_model_len

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"sim-engine-{self.core.worker_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for rid in list(self._streams):
            await self.abort(rid)
        for sub in self._subs:
            sub.lost = True
            with contextlib.suppress(asyncio.QueueFull):
                sub.queue.put_nowait([])

    async def _run(self) -> None:
        core = self.core
        while True:
            if not core.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            res = core.step(self.clock.now())
            await self.clock.sleep(res.duration_s)
            for out in res.outputs:
                q = self._streams.get(out.request_id)
                if q is not None:
                    q.put_nowait(out)
            if res.kv_events:
                self._publish(res.kv_events)

    def _publish(self, events: list[KvEvent]) -> None:
        for sub in self._subs:
            if sub.lost:
                continue
            try:
                sub.queue.put_nowait(events)
            except asyncio.QueueFull:
                sub.lost = True  # the consumer must resync from dump_blocks()

    async def generate(self, req: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self._task is None:
            raise FailedPrecondition("engine not started")
        if req.prompt_token_ids is None:
            if req.prompt is None:
                raise InvalidArgument("prompt", "give prompt_token_ids or prompt")
            req = dataclasses.replace(req, prompt_token_ids=tuple(self.tokenizer.encode(req.prompt)))
        self.core.add_request(req, self.clock.now())
        q: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._streams[req.request_id] = q
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await q.get()
                finished = out.finished
                if out.token_ids:
                    out = dataclasses.replace(out, text=self.tokenizer.decode(out.token_ids))
                yield out
        finally:
            self._streams.pop(req.request_id, None)
            if not finished:
                self.core.abort(req.request_id, self.clock.now())

    async def abort(self, request_id: str) -> bool:
        out = self.core.abort(request_id, self.clock.now())
        if out is None:
            return False
        q = self._streams.get(request_id)
        if q is not None:
            q.put_nowait(out)
        return True

    def load_report(self) -> LoadReport:
        return self.core.load_report(self.clock.now())

    async def kv_event_batches(self) -> AsyncIterator[list[KvEvent]]:
        """Every batch from now on; raises `Unavailable` when this subscriber fell behind (resync)."""
        sub = _Subscriber(self._event_queue_limit)
        self._subs.append(sub)
        try:
            while True:
                if sub.lost and sub.queue.empty():
                    raise Unavailable("KV event subscriber fell behind or engine stopped; resync")
                batch = await sub.queue.get()
                if batch:
                    yield batch
        finally:
            self._subs.remove(sub)

    async def dump_blocks(self) -> list[BlockStored]:
        return self.core.dump_blocks()

    async def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    async def export_blocks(self, block_hashes: Sequence[int]) -> list[KvBlockData]:
        return self.core.export_blocks(block_hashes)

    async def import_blocks(self, blocks: Sequence[KvBlockData]) -> int:
        n = self.core.import_blocks(blocks)
        events = self.core.drain_events()
        if events:
            self._publish(events)
        return n
