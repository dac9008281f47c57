"""The worker's generate-frames listener: `GenerateStream` sessions over plain TCP (`kvmesh.wire.frames`).

One connection is one `GenerateStreamSession`, exactly as one `GenerateStream` call is: the same requests,
responses, cancels, errors and shutdown behaviour, without HTTP/2 and grpc's completion queue between the
socket and the event loop (the router's hot hop; figures in docs/benchmarks.md). Off unless `--frames-port`
is set (for routers run with `--worker-transport frames`): a service mesh sees only TCP bytes here, where it
sees, authorises and measures the gRPC `GenerateStream` per method.

A connection starts with the router's `GenerateFramesHello`. The caller is authorised as a `GenerateStream`
caller by the worker's own guard (the same table, identities and `kvmesh_authz_denied_total`): its mTLS
certificate where the listener has TLS with a client CA (the worker's TLS files), else the hello's bearer
token. A connection that is refused, sends a frame over the worker's request bound, or sends a frame that
does not parse gets one `GenerateStreamResponse` with an empty request id and the error's code, and is
closed; the worker's other connections are untouched. Closing a connection aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import AsyncIterator
from typing import cast

from google.protobuf.message import DecodeError

from kvmesh.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvmesh.rpc.auth import Guard
from kvmesh.rpc.errors import status_code_for
from kvmesh.rpc.tls import server_ssl_context
from kvmesh.security.identity import identity_var
from kvmesh.services.worker import metrics as m
from kvmesh.services.worker.generate_stream import GenerateStreamSession, Outputs
from kvmesh.services.worker.settings import WorkerSettings
from kvmesh.v1 import worker_pb2
from kvmesh.wire.frames import PROTOCOL_VERSION, FrameDecoder, FrameTooLarge, encode_frame

log = logging.getLogger(__name__)

GENERATE_STREAM_METHOD = "/kvmesh.v1.WorkerService/GenerateStream"  # what a connection is authorised as


class FramesConnection(asyncio.Protocol):
    """One router connection: hello, then a `GenerateStreamSession` fed by its frames."""

    def __init__(self, listener: FramesListener) -> None:
        self._listener = listener
        self._decoder = FrameDecoder(listener.max_frame_bytes)
        self._transport: asyncio.Transport | None = None
        self._inbox: asyncio.Queue[worker_pb2.GenerateStreamRequest | None] = asyncio.Queue()
        self._session: asyncio.Task[None] | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self._closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self._listener.connections.add(self)
        m.GENERATE_FRAMES_CONNECTIONS.inc()

    def data_received(self, data: bytes) -> None:
        if self._closed:
            return
        try:
            frames = self._decoder.feed(data)
        except FrameTooLarge as exc:
            self.fail(ResourceExhausted(f"generate frame: {exc}", retry_after_s=0.0), "too_large")
            return
        for frame in frames:
            if self._session is None:
                self._hello(frame)
            else:
                try:
                    msg = worker_pb2.GenerateStreamRequest.FromString(frame)
                except DecodeError:
                    self.fail(InvalidArgument("frame", "not a GenerateStreamRequest"), "malformed")
                    return
                self._inbox.put_nowait(msg)
            if self._closed:
                return

    def _hello(self, frame: bytes) -> None:
        try:
            hello = worker_pb2.GenerateFramesHello.FromString(frame)
        except DecodeError:
            self.fail(InvalidArgument("hello", "the first frame is not a GenerateFramesHello"), "malformed")
            return
        if hello.version != PROTOCOL_VERSION:
            msg = f"generate frames version {hello.version} is not spoken here (this worker speaks {PROTOCOL_VERSION})"
            self.fail(FailedPrecondition(msg), "version")
            return
        identity = None
        guard = self._listener.guard
        if guard is not None:
            assert self._transport is not None
            ssl_object = self._transport.get_extra_info("ssl_object")
            der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
            try:
                identity = guard.admit_identity(
                    GENERATE_STREAM_METHOD, guard.identify_connection(der, hello.authorization)
                )
            except Exception as exc:
                self.fail(exc, "denied")
                return
        ctx = contextvars.copy_context()
        ctx.run(identity_var.set, identity)  # the session's request tasks inherit it (who may abort what)
        self._session = asyncio.get_running_loop().create_task(self._serve(), context=ctx)

    async def _requests(self) -> AsyncIterator[worker_pb2.GenerateStreamRequest]:
        while (msg := await self._inbox.get()) is not None:
            yield msg

    async def _serve(self) -> None:
        session = GenerateStreamSession(self._listener.outputs, self._listener.stopping)
        try:
            async for resp in session.run(self._requests()):
                if self._closed:
                    break
                assert self._transport is not None
                self._transport.write(encode_frame(resp.SerializeToString()))
                if not self._writable.is_set():
                    await self._writable.wait()  # the router reads slower than we produce: hold the steps here
        finally:
            self._close()

    def fail(self, exc: BaseException, reason: str) -> None:
        """Answers `exc` for the whole connection, then closes it."""
        code = status_code_for(exc)
        m.GENERATE_FRAMES_REFUSED.labels(reason).inc()
        log.warning("generate frames connection from %s closed: %s", self._peer(), exc)
        if self._transport is not None and not self._closed:
            resp = worker_pb2.GenerateStreamResponse(error_code=code.value[0], error_message=str(exc))
            self._transport.write(encode_frame(resp.SerializeToString()))
        self._close()

    def _peer(self) -> str:
        peer = self._transport.get_extra_info("peername") if self._transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"

    def close(self) -> None:
        """Closes the connection (aborting its requests)."""
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._transport is not None:
            self._transport.close()  # flushes what was written first
        if self._session is not None and self._session is not asyncio.current_task():
            self._session.cancel()  # aborts the session's requests, as a closed GenerateStream does

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self._writable.set()
        self._inbox.put_nowait(None)
        self._listener.connections.discard(self)
        m.GENERATE_FRAMES_CONNECTIONS.dec()
        if not self._closed:
            self._closed = True
            if self._session is not None:
                self._session.cancel()

    async def wait_closed(self) -> None:
        if self._session is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._session


class FramesListener:
    """The worker's generate-frames server (`--frames-port`; TLS as the worker's gRPC server)."""

    def __init__(
        self,
        outputs: Outputs,
        stopping: asyncio.Event,
        guard: Guard | None,
        settings: WorkerSettings,
        max_frame_bytes: int,
    ) -> None:
        self.outputs = outputs
        self.stopping = stopping
        self.guard = guard
        self.max_frame_bytes = max_frame_bytes
        self.connections: set[FramesConnection] = set()
        self._settings = settings
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        """Binds and starts; returns the address routers reach it at."""
        s = self._settings
        ssl_ctx = server_ssl_context(s.tls_cert, s.tls_key, s.tls_client_ca) if s.tls_cert else None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: FramesConnection(self), s.host, s.frames_port, ssl=ssl_ctx, reuse_address=True
        )
        port = self._server.sockets[0].getsockname()[1]
        host = s.advertise_address.rsplit(":", 1)[0] if s.advertise_address else s.host
        address = f"{host}:{port}"
        log.info("generate frames on %s%s", address, " (TLS)" if ssl_ctx else "")
        return address

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stops accepting; waits up to `grace_s` for the sessions (each ends once `stopping` is set and its
        requests finished), then closes what is left (aborting its requests)."""
        if self._server is not None:
            self._server.close()
        conns = list(self.connections)
        if conns:
            waits = [asyncio.ensure_future(c.wait_closed()) for c in conns]
            _, late = await asyncio.wait(waits, timeout=grace_s)
            for w in late:
                w.cancel()
            for c in conns:
                c.close()
