"""`GenerateStream`: many generation requests multiplexed on one long-lived bidirectional stream.

The router opens one such stream per worker and sends every request it routes there as a `start` message;
each request runs as its own task, and its steps come back tagged with its request id, in order. A request
ends with its final step, or with one message carrying `error_code` / `error_message` / `error_status` (the
status `Generate` would have ended with and its rich details, mapped by `kvmesh.rpc.errors`).
`cancel_request_id` aborts one request; the stream closing (the router going away) aborts all of them. While
the worker shuts down, new starts are refused with UNAVAILABLE and the stream ends once its requests have
finished, so the router moves on to other workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import context as otel_context

from kvmesh.core.errors import InvalidArgument, Unavailable
from kvmesh.rpc.errors import status_code_for, status_details, to_grpc_status
from kvmesh.telemetry import tracing
from kvmesh.telemetry.context import request_id_var
from kvmesh.v1 import worker_pb2

log = logging.getLogger(__name__)

Outputs = Callable[[worker_pb2.GenerateRequest], AsyncIterator[worker_pb2.GenerateResponse]]


class GenerateStreamSession:
    """One GenerateStream call: a reader of the router's messages, a task per request, one writer (this
    generator: responses are yielded in the order the requests' tasks produced them)."""

    def __init__(self, outputs: Outputs, stopping: asyncio.Event) -> None:
        self._outputs = outputs
        self._stopping = stopping
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._out: asyncio.Queue[worker_pb2.GenerateStreamResponse | None] = asyncio.Queue()  # None: the end
        self._reading = True

    async def run(
        self, requests: AsyncIterator[worker_pb2.GenerateStreamRequest]
    ) -> AsyncIterator[worker_pb2.GenerateStreamResponse]:
        reader = asyncio.create_task(self._read(requests))
        watcher = asyncio.create_task(self._end_when_stopping())
        try:
            while True:
                msg = await self._out.get()
                if msg is None:
                    return
                yield msg
        finally:
            reader.cancel()
            watcher.cancel()
            for t in list(self._tasks.values()):
                t.cancel()  # the stream is gone: abort what still runs (the engine stream closes with the task)
            for t in [reader, watcher, *self._tasks.values()]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t

    async def _read(self, requests: AsyncIterator[worker_pb2.GenerateStreamRequest]) -> None:
        try:
            async for msg in requests:
                which = msg.WhichOneof("action")
                if which == "start":
                    self._start(msg.start, msg.traceparent)
                elif which == "cancel_request_id":
                    t = self._tasks.get(msg.cancel_request_id)
                    if t is not None:
                        t.cancel()
        finally:
            self._reading = False
            self._maybe_end()

    def _start(self, req: worker_pb2.GenerateRequest, traceparent: str) -> None:
        rid = req.request_id
        if self._stopping.is_set():
            self._error(rid, Unavailable("worker is shutting down"))
        elif not rid:
            self._error(rid, InvalidArgument("request_id", "required on GenerateStream (responses are matched by it)"))
        elif rid in self._tasks:
            self._error(rid, InvalidArgument("request_id", f"{rid!r} is already in flight on this stream"))
        else:
            self._tasks[rid] = asyncio.create_task(self._serve(req, traceparent))

    async def _serve(self, req: worker_pb2.GenerateRequest, traceparent: str) -> None:
        rid = req.request_id
        request_id_var.set(rid)
        if traceparent:
            otel_context.attach(tracing.extract({"traceparent": traceparent}))
        try:
            async for step in self._outputs(req):
                self._out.put_nowait(worker_pb2.GenerateStreamResponse(request_id=rid, response=step))
        except asyncio.CancelledError:
            pass  # aborted by the router (cancel message or stream closed): the engine stream is closed
        except Exception as exc:
            if status_code_for(exc) == grpc.StatusCode.INTERNAL:
                log.exception("request %s failed", rid)
            self._error(rid, exc)
        finally:
            self._tasks.pop(rid, None)
            self._maybe_end()

    def _error(self, rid: str, exc: BaseException) -> None:
        st = to_grpc_status(exc, rid)
        self._out.put_nowait(
            worker_pb2.GenerateStreamResponse(
                request_id=rid,
                error_code=st.code.value[0],
                error_message=st.details,
                error_status=status_details(st),  # the field an InvalidArgument names reaches the client
            )
        )

    async def _end_when_stopping(self) -> None:
        await self._stopping.wait()
        self._maybe_end()

    def _maybe_end(self) -> None:
        """The stream ends when the router closed its side, or the worker stops, and no request runs."""
        if not self._tasks and (not self._reading or self._stopping.is_set()):
            self._out.put_nowait(None)
