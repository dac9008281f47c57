"""The worker's runtime state: engine, KV event log, the pump from engine events to the log and its sinks."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvmesh.core.errors import Unavailable
from kvmesh.core.kvevents import AllBlocksCleared, KvEvent, KvEventBatch, LoadReport
from kvmesh.core.tasks import stop_task
from kvmesh.engine.base import Engine
from kvmesh.services.worker import metrics as m
from kvmesh.services.worker.kvlog import KvEventLog

if TYPE_CHECKING:
    from kvmesh.services.worker.admission import WindowGate

log = logging.getLogger(__name__)


class WorkerApp:
    """Owns the engine and the event log; `start()` after the engine started, `stop()` before it stops."""

    def __init__(self, engine: Engine, engine_kind: str, worker_id: str, buffer: int = 10_000) -> None:
        self.engine = engine
        self.engine_kind = engine_kind
        self.instance_id = uuid.uuid4().hex
        self.log = KvEventLog(worker_id, self.instance_id, buffer=buffer)
        self.stopping = asyncio.Event()
        self.sinks: list[Callable[[KvEventBatch], None]] = []
        self.address = ""
        self.kvsync_address = ""  # the worker's KvSyncService (empty: no tier served)
        self.frames_address = ""  # the generate-frames listener (empty: off)
        self.tier_region = ""
        self.tier_shm_name = ""
        self.tier_blocks_total = 0
        self.tier_block_bytes = 0
        self.gate: WindowGate | None = None  # the batching window requests wait in (None: off)
        # hands a prefill half's KV over by the engine's own transfer (vLLM's NixlConnector), besides kv-sync
        self.engine_handoff = False
        self._pump_task: asyncio.Task[None] | None = None

    @property
    def worker_id(self) -> str:
        return self.log.worker_id

    def set_worker_id(self, worker_id: str) -> None:
        """Set before the first event (the id is known once the gRPC port is bound)."""
        self.log.worker_id = worker_id

    def start(self) -> None:
        self._pump_task = asyncio.create_task(self._pump(), name="kv-event-pump")

    async def stop(self) -> None:
        self.stopping.set()
        if self._pump_task is not None:
            await stop_task(self._pump_task)

    def load(self) -> LoadReport:
        r = self.engine.load_report()
        r.worker_id = self.worker_id
        if self.gate is not None:  # requests in the batching window are waiting too
            r.waiting += len(self.gate.window)
        m.observe_load(r)
        return r

    def _append(self, events: list[KvEvent]) -> None:
        batch = self.log.append(events, time.time())
        m.KV_EVENT_SEQ.set(batch.sequence)
        for sink in self.sinks:
            try:
                sink(batch)
            except Exception:
                log.exception("KV event sink failed")

    async def _pump(self) -> None:
        """Engine batches -> log. If the engine drops this subscriber, re-subscribe, then append one batch
        [AllBlocksCleared, dump...] so every consumer converges through ordinary sequenced events."""
        first = True
        while not self.stopping.is_set():
            it = self.engine.kv_event_batches()
            if not first:
                blocks = await self.engine.dump_blocks()
                self._append([AllBlocksCleared(), *blocks])
            first = False
            try:
                async for events in it:
                    self._append(list(events))
                return
            except Unavailable:
                if self.stopping.is_set():
                    return
                log.warning("engine KV event stream lost; resyncing from a dump")
