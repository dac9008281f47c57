"""The router's transport to a worker: every request on one long-lived `WorkerService.GenerateStream`.

A `Generate` call per request costs a new HTTP/2 stream, headers, trailers and a call object on both sides;
on loopback that is ~0.25 ms of a ~0.6 ms Python gRPC hop (`python -m kvmesh.bench router` figures in
docs/benchmarks.md). `WorkerStream` opens the stream on first use, writes each request's `start` (its wire
bytes pre-built, in order, one write at a time) and hands the responses, matched by request id, to a
`StreamedRequest` that the router's request path uses exactly like a unary-stream call:

- iterating yields the worker's `GenerateResponse` steps and stops after the final one;
- a worker error for that request (`error_code`) or the stream breaking (the worker died, restarted or shut
  down) raises `grpc.aio.AioRpcError` with the status code a `Generate` call would have ended with, so
  retries, migrations and breaker accounting are the same on both transports;
- `cancel()` sends `cancel_request_id` (the worker aborts the request).

A broken stream fails every request pending on it at once and is reopened by the next request.

Both transports share the per-attempt helpers at the end: the request's wire bytes (`worker_request_bytes`,
`attempt_request_bytes`: the prompt is serialised once and spliced in), `classify` (a worker's status code
as a `kvmesh.routing.attempts.Failure`) and `close_call` (cancel now, or after a finished call's grace).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol, TypeAlias

import grpc
from grpc.aio import Metadata

from kvmesh.routing.attempts import Failure, NextAttempt
from kvmesh.v1 import common_pb2, worker_pb2
from kvmesh.wire.protowire import length_delimited

log = logging.getLogger(__name__)

GENERATE_STREAM_METHOD = "/kvmesh.v1.WorkerService/GenerateStream"
_FIELDS = worker_pb2.GenerateStreamRequest.DESCRIPTOR.fields_by_name
_START = _FIELDS["start"].number
_TRACEPARENT = _FIELDS["traceparent"].number
_STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}  # error_code on the wire -> grpc code
_TOKEN_IDS_FIELD = worker_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["token_ids"].number


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a `Generate` call would have raised."""
    return grpc.aio.AioRpcError(code, Metadata(), Metadata(), details=details)


class RequestCarrier(Protocol):
    """What a `StreamedRequest` was sent on: a `WorkerStream` or a `FramedWorkerStream`."""

    def forget(self, request_id: str, req: StreamedRequest) -> None: ...

    def send_cancel(self, request_id: str) -> None: ...


class StreamedRequest:
    """One request on a `WorkerStream` (or on generate frames), used like a grpc.aio unary-stream call (see
    the module docstring)."""

    __slots__ = ("_cancelled", "_done", "_queue", "_stream", "call", "request_id")

    def __init__(self, stream: RequestCarrier, request_id: str, call: object) -> None:
        self._stream = stream
        self.request_id = request_id
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
                raise rpc_error(_STATUS_CODES.get(item.error_code, grpc.StatusCode.UNKNOWN), item.error_message)
            step = item.response
            if step.finish_reason:
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


class WorkerStream:
    """One worker's GenerateStream, shared by every request the router sends there."""

    def __init__(self, channel: grpc.aio.Channel, address: str) -> None:
        self.address = address
        self._open = channel.stream_stream(
            GENERATE_STREAM_METHOD,
            request_serializer=None,  # requests are written as pre-built wire bytes
            response_deserializer=worker_pb2.GenerateStreamResponse.FromString,
        )
        self._call: grpc.aio.StreamStreamCall | None = None
        self._pending: dict[str, StreamedRequest] = {}
        self._write_lock = asyncio.Lock()
        self._background: set[asyncio.Task[None]] = set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def start(self, request_id: str, request_bytes: bytes, traceparent: str = "") -> StreamedRequest:
        """Sends a serialised `GenerateRequest` (whose request_id is `request_id`) and returns its handle."""
        if request_id in self._pending:
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"request {request_id!r} already in flight here")
        call = self._call
        if call is None or call.done():
            call = self._call = self._open()
            self._spawn(self._read(call))
        req = self._pending[request_id] = StreamedRequest(self, request_id, call)
        msg = length_delimited(_START, request_bytes)
        if traceparent:
            msg += length_delimited(_TRACEPARENT, traceparent.encode())
        try:
            async with self._write_lock:
                await call.write(msg)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            self._pending.pop(request_id, None)
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"generate stream to {self.address} broke: {e}") from None
        except BaseException:  # cancelled while writing: the start may have gone out, so abort it too
            self._pending.pop(request_id, None)
            self.send_cancel(request_id)
            raise
        return req

    def forget(self, request_id: str, req: StreamedRequest) -> None:
        if self._pending.get(request_id) is req:
            del self._pending[request_id]

    def send_cancel(self, request_id: str) -> None:
        call = self._call
        if call is None or call.done():
            return  # the stream is gone, and with it the request
        msg = worker_pb2.GenerateStreamRequest(cancel_request_id=request_id).SerializeToString()
        self._spawn(self._write_quietly(call, msg))

    async def _write_quietly(self, call: grpc.aio.StreamStreamCall, msg: bytes) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError):
            async with self._write_lock:
                await call.write(msg)

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        err: grpc.aio.AioRpcError
        try:
            async for msg in call:
                req = self._pending.get(msg.request_id)
                if req is not None:
                    req.deliver(msg)
            err = rpc_error(grpc.StatusCode.UNAVAILABLE, f"worker {self.address} closed its generate stream")
        except grpc.aio.AioRpcError as e:
            err = rpc_error(e.code(), e.details() or "")
        except asyncio.CancelledError:
            err = rpc_error(grpc.StatusCode.CANCELLED, "router closing")
        except Exception as e:  # e.g. an undecodable message: the stream is unusable, fail what waits on it
            log.exception("generate stream to %s failed", self.address)
            call.cancel()
            err = rpc_error(grpc.StatusCode.UNAVAILABLE, f"generate stream to {self.address} failed: {e!r}")
        if self._call is call:
            self._call = None
        for rid, req in list(self._pending.items()):
            if req.call is call:
                del self._pending[rid]
                req.deliver(err)
        if err.code() != grpc.StatusCode.CANCELLED:
            log.info("generate stream to %s ended: %s", self.address, err.details())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        call = self._call
        if call is not None:
            call.cancel()
        for t in list(self._background):
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t


# Worker errors that say "this request is wrong", not "this worker is broken": passed to the client.
_CLIENT_ERRORS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION}
TRAILERS_GRACE_S = 5.0  # after a worker's final message, how long its call may take to end on its own

WorkerCall: TypeAlias = grpc.aio.UnaryStreamCall | StreamedRequest  # what `WorkerHandle.generate` returns


def worker_request_bytes(head: worker_pb2.GenerateRequest, token_ids: bytes) -> bytes:
    """Wire bytes of `head` with `token_ids` (a serialised `TokenIds`) as its token_ids field: protobuf parses
    fields in any order, so the prompt is serialised once per request and never copied into a new message
    (an 8K-token CopyFrom costs ~90 µs). Concatenated `TokenIds` encodings merge (their ids concatenate)."""
    return head.SerializeToString() + length_delimited(_TOKEN_IDS_FIELD, token_ids)


def attempt_request_bytes(
    head: worker_pb2.GenerateRequest,
    sampling: common_pb2.SamplingParams,
    plan: NextAttempt,
    prompt_bytes: bytes,
    so_far: list[int],
) -> bytes:
    """Wire bytes of one attempt's request: `head` with `sampling` as `plan` adjusts it, and as token ids
    `prompt_bytes` (a serialised `TokenIds`) followed by `so_far`, the tokens generated before (a migration
    resumes there)."""
    sp = head.sampling
    sp.CopyFrom(sampling)
    sp.max_tokens, sp.min_tokens = plan.max_tokens, plan.min_tokens
    ids = prompt_bytes + common_pb2.TokenIds(ids=so_far).SerializeToString() if so_far else prompt_bytes
    return worker_request_bytes(head, ids)


def classify(e: grpc.aio.AioRpcError, call: WorkerCall | None) -> Failure:
    """How a worker call failed, for `kvmesh.routing.attempts.decide`: CANCELLED counts as the caller's own
    cancel only when the caller did cancel `call`; otherwise (a worker shutting down) it is a worker failure."""
    code = e.code()
    if code in _CLIENT_ERRORS:
        return Failure.CLIENT_ERROR
    if code == grpc.StatusCode.CANCELLED and call is not None and call.cancelled():
        return Failure.CANCELLED
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Failure.RESOURCE_EXHAUSTED
    return Failure.WORKER


def close_call(call: WorkerCall | None, finished: bool) -> None:
    """Ends an attempt's call: a finished one gets `TRAILERS_GRACE_S` to end on its own (its trailers are on
    their way: no abort, and none on the client's critical path); any other is cancelled now."""
    if call is None or call.done():
        return
    if finished:
        asyncio.get_running_loop().call_later(TRAILERS_GRACE_S, _cancel_if_pending, call)
    else:
        call.cancel()


def _cancel_if_pending(call: WorkerCall) -> None:
    if not call.done():
        call.cancel()
