"""The router's default transport to a worker: every request on one long-lived `WorkerService.GenerateStream`.

A `Generate` call per request costs a new HTTP/2 stream, headers, trailers and a call object on both sides;
on loopback that is ~0.25 ms of a ~0.6 ms Python gRPC hop (`python -m kvmesh.bench router` figures in
docs/benchmarks.md). `WorkerStream` opens the stream on first use, writes each request's `start` (its wire
bytes pre-built, in order, one write at a time) and hands the responses, matched by request id, to a
`StreamedRequest` (`stream_requests`) that the router's request path uses exactly like a unary-stream call.
It stays a gRPC call, so a service mesh sees, authorises and measures it per method (the opt-in generate
frames of `worker_frames` carry the same messages past the mesh, unseen).

A broken stream fails every request pending on it at once and is reopened by the next request.

Both transports share the per-attempt helpers at the end: the request's wire bytes (`worker_request_bytes`,
`attempt_request_bytes`: the prompt is serialised once and spliced in), `classify` (a worker's status code
as a `kvmesh.routing.attempts.Failure`) and `close_call` (cancel an attempt that did not finish).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeAlias

import grpc

from kvmesh.routing.attempts import Failure, NextAttempt
from kvmesh.services.router.stream_requests import StreamedRequest, cancel_message, rpc_error, start_message
from kvmesh.v1 import common_pb2, worker_pb2
from kvmesh.wire.protowire import length_delimited

log = logging.getLogger(__name__)

GENERATE_STREAM_METHOD = "/kvmesh.v1.WorkerService/GenerateStream"
_TOKEN_IDS_FIELD = worker_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["token_ids"].number


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

    async def start(
        self, request_id: str, request_bytes: bytes, traceparent: str = "", sequences: int = 1
    ) -> StreamedRequest:
        """Sends a serialised `GenerateRequest` (whose request_id is `request_id`) and returns its handle."""
        if request_id in self._pending:
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"request {request_id!r} already in flight here")
        call = self._call
        if call is None or call.done():
            call = self._call = self._open()
            self._spawn(self._read(call))
        req = self._pending[request_id] = StreamedRequest(self, request_id, call, sequences)
        try:
            async with self._write_lock:
                await call.write(start_message(request_bytes, traceparent))
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
        self._spawn(self._write_quietly(call, cancel_message(request_id)))

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
WorkerCall: TypeAlias = StreamedRequest  # what `WorkerHandle.generate` returns, on either transport


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
    resumes there; the prompt's log-probabilities went with the first attempt, they are not asked again)."""
    sp = head.sampling
    sp.CopyFrom(sampling)
    sp.max_tokens, sp.min_tokens = plan.max_tokens, plan.min_tokens
    if so_far:  # a resumed attempt's would cover the tokens so far too, and reach a gRPC client twice
        sp.ClearField("prompt_logprobs")
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
    """Ends an attempt's request: a finished one has ended on the worker already (its final step was read);
    any other is cancelled there now."""
    if call is not None and not finished and not call.done():
        call.cancel()
