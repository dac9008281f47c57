"""Synchronous facade over `AsyncClient`: its event loop runs in one background thread.

Every wait on the loop is bounded by the client's `timeout_s` (plus a second of slack). Keyword arguments
(`security=ChannelSecurity(...)` for TLS among them) go to `AsyncClient`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from kvmesh.client.aio import AsyncClient
from kvmesh.v1 import router_pb2


class Client:
    def __init__(self, failover_targets: Sequence[str] = (), routers: Sequence[str] = (), **kw: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvmesh-client", daemon=True)
        self._thread.start()
        self._aclient = self._run(self._make(list(failover_targets), list(routers), kw))
        self._bound = self._aclient.timeout_s + 1.0
        self._run(self._aclient.start())

    @staticmethod
    async def _make(f: list[str], r: list[str], kw: dict[str, Any]) -> AsyncClient:
        return AsyncClient(f, r, **kw)

    def _run(self, coro: Any, timeout_s: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def generate(
        self, request: router_pb2.RouterServiceGenerateRequest
    ) -> Iterator[router_pb2.RouterServiceGenerateResponse]:
        agen = self._aclient.generate(request)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__(), self._bound)
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose(), self._bound)

    def close(self) -> None:
        self._run(self._aclient.close(), self._bound)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
