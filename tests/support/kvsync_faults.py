"""A KvSyncService whose ReadBlocks stream breaks after a set number of messages, as a peer's does when it
is killed (`stall=False`: the stream ends UNAVAILABLE) or hangs (`stall=True`: it stays open, sends nothing,
and sets `stalled`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvmesh.kvsync.service import KvSyncServicer
from kvmesh.v1 import kvsync_pb2


class BreakingKvSync(KvSyncServicer):
    """ReadBlocks sends `messages` messages, then dies or (`stall`) hangs."""

    def __init__(self, *args: Any, messages: int = 1 << 30, stall: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.messages, self.stall = messages, stall
        self.stalled = asyncio.Event()

    async def ReadBlocks(  # type: ignore[override]
        self, request: kvsync_pb2.ReadBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        sent = 0
        async for raw in super().ReadBlocks(request, context):
            if sent == self.messages:
                if self.stall:
                    self.stalled.set()
                    await asyncio.Event().wait()
                await context.abort(grpc.StatusCode.UNAVAILABLE, "peer went away")
            yield raw
            sent += 1
