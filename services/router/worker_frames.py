"""The router's opt-in transport to a worker over generate frames (`kvmesh.wire.frames`): `GenerateStream`'s
messages on one plain TCP (or TLS) connection per worker, without HTTP/2 and grpc's completion queue.

It saves router CPU on every request (docs/benchmarks.md) at a price: the connection is no gRPC call, so a
service mesh can neither see, authorise, retry nor measure it per method; it is only TCP (or TLS) bytes to
the worker's `--frames-port`. Hence `--worker-transport stream` is the default and this is chosen, on the
router and the workers, where the router's hop matters more than the mesh's view (docs/operations.md).

`FramedWorkerStream` is a drop-in for `WorkerStream`: `start` returns the same `StreamedRequest`, so a request
iterates, fails (`grpc.aio.AioRpcError` with the code a `Generate` call would have ended with), cancels,
retries and migrates exactly as on the gRPC stream. It connects on first use and again after a break:

- the connection opens with a `GenerateFramesHello` (protocol version, the router's bearer token; with mTLS
  the client certificate is the identity), then carries `start` / `cancel_request_id` frames; start frames
  are written without waiting for an answer to the hello, since the worker reads them in order;
- a frame from the worker with an empty request id fails the whole connection with its code (refused,
  version, frame too large) and every request pending on it;
- the connection breaking (the worker died, restarted, shut down, or the router reset it when the worker's
  load stream broke) fails every pending request with UNAVAILABLE.

`ConnectFailed` (the port does not answer) is what lets `WorkerHandle.generate` fall back to the gRPC stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import cast

import grpc
from google.protobuf.message import DecodeError

from kvmesh.core.config import ServerSettings
from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.rpc.tls import client_ssl_context
from kvmesh.services.router.stream_requests import (
    StreamedRequest,
    cancel_message,
    rpc_error,
    start_message,
    status_code,
)
from kvmesh.v1 import worker_pb2
from kvmesh.wire.frames import DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION, FrameDecoder, FrameTooLarge, encode_frame

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0


class ConnectFailed(Exception):
    """The worker's generate-frames listener could not be reached (the caller may use another transport)."""


class _Connection(asyncio.Protocol):
    """One TCP connection's byte stream to and from frames; everything else is the owner's."""

    def __init__(self, owner: FramedWorkerStream) -> None:
        self._owner = owner
        self._decoder = FrameDecoder(owner.max_frame_bytes)
        self.transport: asyncio.Transport | None = None
        self.writable = asyncio.Event()
        self.writable.set()
        self.lost = False
        self.error: grpc.aio.AioRpcError | None = None  # why it failed (the first reason)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._decoder.feed(data)
            for frame in frames:
                self._owner.received(self, worker_pb2.GenerateStreamResponse.FromString(frame))
        except (FrameTooLarge, DecodeError) as exc:
            log.error("generate frames from %s: %s", self._owner.address, exc)
            self._owner.failed(self, grpc.StatusCode.UNAVAILABLE, f"bad frame from {self._owner.address}: {exc}")

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.writable.set()
        why = f": {exc}" if exc else ""
        self._owner.failed(self, grpc.StatusCode.UNAVAILABLE, f"worker {self._owner.address} closed its frames{why}")

    def write(self, payload: bytes) -> None:
        if self.transport is not None and not self.lost:
            self.transport.write(encode_frame(payload))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class FramedWorkerStream:
    """One worker's generate-frames connection, shared by every request the router sends there."""

    def __init__(self, address: str, settings: ServerSettings, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.address = address
        self.max_frame_bytes = max_frame_bytes
        self._security = ChannelSecurity.of(settings)
        self._ssl: ssl.SSLContext | None = None
        self._conn: _Connection | None = None
        self._connecting: asyncio.Future[_Connection] | None = None
        self._pending: dict[str, StreamedRequest] = {}
        self._idle = asyncio.Event()  # no request pending
        self._idle.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def start(
        self, request_id: str, request_bytes: bytes, traceparent: str = "", sequences: int = 1
    ) -> StreamedRequest:
        """Sends a serialised `GenerateRequest` (whose request_id is `request_id`) and returns its handle;
        raises `ConnectFailed` when the worker's listener cannot be reached."""
        if request_id in self._pending:
            raise rpc_error(grpc.StatusCode.INVALID_ARGUMENT, f"request {request_id!r} already in flight here")
        conn = self._conn
        if conn is None or conn.lost:
            conn = await self._connection()
            if conn.error is not None:  # failed (refused, closed) while this request waited for it
                raise conn.error
        req = self._pending[request_id] = StreamedRequest(self, request_id, conn, sequences)
        self._idle.clear()
        conn.write(start_message(request_bytes, traceparent))
        if not conn.writable.is_set():
            try:
                await conn.writable.wait()  # the worker reads slower than we send: hold the caller here
            except BaseException:
                self._drop(request_id, req)
                self.send_cancel(request_id)
                raise
        return req

    async def _connection(self) -> _Connection:
        """The live connection, opened once however many requests wait for it."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._connect())
        fut = self._connecting
        try:
            return await asyncio.shield(fut)
        finally:
            if fut.done() and self._connecting is fut:
                self._connecting = None

    async def _connect(self) -> _Connection:
        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")  # an IPv6 literal
        sec = self._security
        if sec.tls_ca and self._ssl is None:
            self._ssl = client_ssl_context(sec.tls_ca, sec.tls_client_cert, sec.tls_client_key)
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(self),
                    host,
                    int(port),
                    ssl=self._ssl,
                    server_hostname=host if self._ssl else None,
                ),
                CONNECT_TIMEOUT_S,
            )
        except (OSError, TimeoutError, ValueError) as exc:
            raise ConnectFailed(f"generate frames at {self.address}: {exc!r}") from None
        hello = worker_pb2.GenerateFramesHello(version=PROTOCOL_VERSION)
        if sec.token:
            hello.authorization = f"Bearer {sec.token}"
        conn.write(hello.SerializeToString())
        self._conn = conn
        return conn

    def received(self, conn: _Connection, msg: worker_pb2.GenerateStreamResponse) -> None:
        if msg.request_id:
            req = self._pending.get(msg.request_id)
            if req is not None:
                req.deliver(msg)
        elif msg.error_code:  # the worker fails the whole connection, then closes it
            code = status_code(msg.error_code)
            log.warning("worker %s refused generate frames: %s %s", self.address, code.name, msg.error_message)
            self.failed(conn, code, msg.error_message)

    def failed(self, conn: _Connection, code: grpc.StatusCode, details: str) -> None:
        """Fails every request sent on `conn` with `code` and drops the connection (the next start reconnects)."""
        conn.lost = True
        conn.close()
        if self._conn is conn:
            self._conn = None
        err = rpc_error(code, details)
        if conn.error is None:
            conn.error = err
        for rid, req in list(self._pending.items()):
            if req.call is conn:
                self._drop(rid, req)
                req.deliver(err)

    def forget(self, request_id: str, req: StreamedRequest) -> None:
        self._drop(request_id, req)

    def _drop(self, request_id: str, req: StreamedRequest) -> None:
        if self._pending.get(request_id) is req:
            del self._pending[request_id]
            if not self._pending:
                self._idle.set()

    def send_cancel(self, request_id: str) -> None:
        conn = self._conn
        if conn is not None and not conn.lost:
            conn.write(cancel_message(request_id))

    def reset(self, reason: str) -> None:
        """Drops the connection now, failing its requests (the worker's load stream broke: a frozen worker
        would otherwise hold them, since TCP alone does not notice)."""
        if self._conn is not None:
            self.failed(self._conn, grpc.StatusCode.UNAVAILABLE, f"worker {self.address}: {reason}")

    async def close(self, grace_s: float = 0.0) -> None:
        """Closes the connection, after its pending requests ended or `grace_s` passed (0: now, failing them)."""
        if grace_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), grace_s)
        if self._connecting is not None:
            self._connecting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._connecting
        if self._conn is not None:
            self.failed(self._conn, grpc.StatusCode.CANCELLED, "router closing")
