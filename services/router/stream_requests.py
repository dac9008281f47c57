"""What the router's two worker transports share: `GenerateStream`'s messages and the per-request handle.

Both transports carry the same messages: the gRPC stream (`worker_stream.WorkerStream`, the default) as
`WorkerService.GenerateStream` calls, generate frames (`worker_frames.FramedWorkerStream`, opt-in) as
length-prefixed frames on a TCP connection (`kvmesh.wire.frames`). So the request's bytes, its cancel, the
mapping of a worker's `error_code` back to a gRPC status and the handle a request is read through live here
once, and a request retries, migrates and cancels the same on either.

`StreamedRequest` is used by the router's request path like a grpc.aio unary-stream call:

- iterating yields the worker's `GenerateResponse` steps and stops after the final one: the step that
  finishes the last of the request's `sequences` (its n; each sequence's last step has a finish reason);
- a worker error for that request (`error_code`) or its connection breaking (the worker died, restarted or
  shut down) raises `grpc.aio.AioRpcError` with the status code a `Generate` call would have ended with, so
  retries, migrations and breaker accounting do not depend on the transport;
- `cancel()` sends `cancel_request_id` (the worker aborts the request).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

import grpc
from grpc.aio import Metadata

from kvmesh.rpc.errors import details_trailers
from kvmesh.v1 import worker_pb2
from kvmesh.wire.protowire import length_delimited

_FIELDS = worker_pb2.GenerateStreamRequest.DESCRIPTOR.fields_by_name
_START = _FIELDS["start"].number
_TRACEPARENT = _FIELDS["traceparent"].number
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}  # error_code on the wire -> grpc code


def start_message(request_bytes: bytes, traceparent: str = "") -> bytes:
    """A serialised `GenerateStreamRequest` starting the request whose serialised `GenerateRequest` is
    `request_bytes`: spliced in as the `start` field, not parsed and copied into a new message."""
    msg = length_delimited(_START, request_bytes)
    if traceparent:
        msg += length_delimited(_TRACEPARENT, traceparent.encode())
    return msg


def cancel_message(request_id: str) -> bytes:
    """A serialised `GenerateStreamRequest` that makes the worker abort `request_id`."""
    return worker_pb2.GenerateStreamRequest(cancel_request_id=request_id).SerializeToString()


def status_code(error_code: int) -> grpc.StatusCode:
    """The gRPC status a worker's `error_code` names (UNKNOWN for a code this grpc does not know)."""
    return _STATUS_CODES.get(error_code, grpc.StatusCode.UNKNOWN)


def rpc_error(code: grpc.StatusCode, details: str, status: bytes = b"") -> grpc.aio.AioRpcError:
    """The error a `Generate` call would have raised, its trailers carrying `status` (a worker's serialised
    google.rpc.Status: the field it named, `kvmesh.rpc.errors.invalid_field`)."""
    return grpc.aio.AioRpcError(code, Metadata(), Metadata(*details_trailers(status)), details=details)


class RequestCarrier(Protocol):
    """What a `StreamedRequest` was sent on: a `WorkerStream` or a `FramedWorkerStream`."""

    def forget(self, request_id: str, req: StreamedRequest) -> None: ...

    def send_cancel(self, request_id: str) -> None: ...


class StreamedRequest:
    """One request on a worker transport, used like a grpc.aio unary-stream call (see the module docstring)."""

    __slots__ = ("_cancelled", "_done", "_queue", "_stream", "_unfinished", "call", "request_id")

    def __init__(self, stream: RequestCarrier, request_id: str, call: object, sequences: int = 1) -> None:
        self._stream = stream
        self.request_id = request_id
        self._unfinished = sequences
        self.call = call  # the stream call (or frames connection) it was sent on: a break fails its requests
        self._queue: asyncio.Queue[worker_pb2.GenerateStreamResponse | grpc.aio.AioRpcError] = asyncio.Queue()
        self._done = False
        self._cancelled = False

    def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        return self._steps()

    async def _steps(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        while not self._done:
            item = await self._queue.get()
            if isinstance(item, grpc.aio.AioRpcError):
                self._finish()
                raise item
            if item.error_code:
                self._finish()
                raise rpc_error(status_code(item.error_code), item.error_message, item.error_status)
            step = item.response
            if step.finish_reason:
                self._unfinished -= 1
                if self._unfinished <= 0:
                    self._finish()  # done before the final step is handed out: the caller may stop iterating there
            yield step

    def deliver(self, item: worker_pb2.GenerateStreamResponse | grpc.aio.AioRpcError) -> None:
        self._queue.put_nowait(item)

    def _finish(self) -> None:
        self._done = True
        self._stream.forget(self.request_id, self)

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> bool:
        """Aborts the request on the worker; False if it had already ended."""
        if self._done:
            return False
        self._cancelled = True
        self._finish()
        self._stream.send_cancel(self.request_id)
        return True
