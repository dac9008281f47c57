"""Test-only stand-in for the authorisation core: sets the caller's identity for each handler from metadata.

The server skeleton (`kvmesh.rpc.server`) resolves a caller's identity from its certificate or bearer token
and sets `kvmesh.security.identity.identity_var` for the handler. Until that core lands, the per-role tests
of the services run their servicers on an in-process `grpc.aio` server (real gRPC, a real loopback socket)
with this interceptor, which takes ``x-test-identity: <role>:<id>`` from the call's metadata instead. It
authenticates nothing and exists only in tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvmesh.rpc.interceptors import InstrumentedServer, MessageBounds
from kvmesh.security.identity import CallerRole, Identity, identity_var

HEADER = "x-test-identity"


def metadata_of(ident: Identity | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that makes the stand-in set `ident` (nothing: anonymous)."""
    return ((HEADER, f"{ident.role.value}:{ident.id}"),) if ident is not None else ()


def _identity(details: grpc.HandlerCallDetails) -> Identity | None:
    for k, v in details.invocation_metadata or ():  # type: ignore[attr-defined]
        if k == HEADER:
            role, _, ident = str(v).partition(":")
            return Identity(CallerRole(role), ident)
    return None


def _unary(fn: Callable[..., Awaitable[Any]], ident: Identity) -> Callable[..., Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        identity_var.set(ident)  # the call's own task context: nothing leaks to other calls
        return await fn(request, context)

    return call


def _streaming(fn: Callable[..., Any], ident: Identity) -> Callable[..., AsyncIterator[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        identity_var.set(ident)
        async for msg in fn(request, context):
            yield msg

    return call


class IdentityStandIn(grpc.aio.ServerInterceptor):
    """Wraps each handler so it runs with the identity named by the ``x-test-identity`` header (see module)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        h = await continuation(details)
        ident = _identity(details)
        if h is None or ident is None:
            return h
        kw = {"request_deserializer": h.request_deserializer, "response_serializer": h.response_serializer}
        if h.unary_unary:
            return grpc.unary_unary_rpc_method_handler(_unary(h.unary_unary, ident), **kw)
        if h.stream_unary:
            return grpc.stream_unary_rpc_method_handler(_unary(h.stream_unary, ident), **kw)
        if h.unary_stream:
            return grpc.unary_stream_rpc_method_handler(_streaming(h.unary_stream, ident), **kw)
        return grpc.stream_stream_rpc_method_handler(_streaming(h.stream_stream, ident), **kw)


async def serve(add: Callable[[Any, Any], None], servicer: Any, service: str) -> tuple[grpc.aio.Server, str]:
    """An in-process server on 127.0.0.1 (port 0) running `servicer` instrumented as the services run theirs
    (error mapping, message bounds), behind the stand-in; returns (server, address)."""
    server = grpc.aio.server(interceptors=[IdentityStandIn()])
    add(servicer, InstrumentedServer(server, service, MessageBounds(64 << 20)))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"
