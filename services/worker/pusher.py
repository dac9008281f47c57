"""Pushes the worker's KV event log to the cache-manager (`PublishKvEvents`), with the resync protocol.

Session: hello -> ack. If the ack asks for a resync, or expects nothing yet (next_sequence 0), or expects a
sequence no longer buffered: full dump (DUMP_BEGIN / CHUNK / END, sequence = last live batch included);
else replay the buffered batches from next_sequence. Then live batches, one ack each; an ack with
`resync_required` triggers a dump. A lost session reconnects with exponential backoff (0.2 s .. 5 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import grpc

from kvmesh.core.config import ServerSettings
from kvmesh.core.errors import Unavailable
from kvmesh.core.tasks import stop_task
from kvmesh.rpc.channel import open_channel
from kvmesh.services.worker.app import WorkerApp
from kvmesh.services.worker.servicer import next_or_stop
from kvmesh.v1 import cache_manager_pb2 as cm
from kvmesh.v1 import cache_manager_pb2_grpc as cm_grpc
from kvmesh.v1 import common_pb2
from kvmesh.wire.proto import batch_to_proto, dump_messages

log = logging.getLogger(__name__)
LIVE = common_pb2.KV_STREAM_KIND_LIVE


class CacheManagerPusher:
    def __init__(self, app: WorkerApp, address: str, settings: ServerSettings) -> None:
        self.app = app
        self.address = address
        self.settings = settings
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kv-pusher")

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task)

    async def _run(self) -> None:
        backoff = 0.2
        while not self.app.stopping.is_set():
            try:
                await self._session()
                backoff = 0.2
            except (grpc.aio.AioRpcError, Unavailable, ConnectionError) as e:
                log.warning("KV event push to %s failed: %s", self.address, e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.app.stopping.wait(), backoff)
            backoff = min(backoff * 2, 5.0)

    async def _send(self, call: Any, req: cm.PublishKvEventsRequest) -> cm.PublishKvEventsResponse:
        await call.write(req)
        ack = await call.read()
        if ack is grpc.aio.EOF:
            raise Unavailable("cache-manager closed the publish stream")
        return ack  # type: ignore[no-any-return]

    async def _dump(self, call: Any) -> int:
        lg = self.app.log
        seq, blocks = lg.dump()
        for kind, b in dump_messages(lg.worker_id, lg.instance_id, seq, blocks, time.time()):
            await self._send(call, cm.PublishKvEventsRequest(kind=kind, batch=b))
        return seq

    async def _sync(self, call: Any, ack: cm.PublishKvEventsResponse) -> int:
        lg = self.app.log
        if not ack.resync_required and ack.next_sequence >= 1:
            replay = lg.replay(ack.next_sequence)
            if replay is not None:
                sent = ack.next_sequence - 1
                for b in replay:
                    ack = await self._send(call, cm.PublishKvEventsRequest(kind=LIVE, batch=batch_to_proto(b)))
                    sent = b.sequence
                    if ack.resync_required:
                        return await self._dump(call)
                return sent
        return await self._dump(call)

    async def _session(self) -> None:
        app, lg = self.app, self.app.log
        channel = open_channel(self.address, self.settings)
        cursor = lg.open_cursor()
        try:
            call = cm_grpc.CacheManagerServiceStub(channel).PublishKvEvents()
            hello = cm.WorkerHello(
                worker_id=lg.worker_id,
                instance_id=lg.instance_id,
                address=app.address,
                block_size=app.engine.block_size,
                model=app.engine.model_name,
                zone=self.settings.zone,
            )
            sent = await self._sync(call, await self._send(call, cm.PublishKvEventsRequest(hello=hello)))
            ended: asyncio.Future[object] = asyncio.ensure_future(call.code())
            try:
                while not app.stopping.is_set():
                    if cursor.lost:
                        lg.close_cursor(cursor)
                        cursor = lg.open_cursor()
                        sent = await self._dump(call)
                    batch = await next_or_stop(cursor, app.stopping, ended)
                    if ended.done():
                        raise Unavailable(f"publish stream ended: {ended.result()}")
                    if batch is None:
                        break
                    if batch.sequence <= sent:
                        continue
                    ack = await self._send(call, cm.PublishKvEventsRequest(kind=LIVE, batch=batch))
                    sent = batch.sequence
                    if ack.resync_required:
                        sent = await self._sync(call, ack)
                await call.done_writing()
            finally:
                ended.cancel()
        finally:
            lg.close_cursor(cursor)
            await channel.close()
