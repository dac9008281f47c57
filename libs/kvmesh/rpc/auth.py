"""The per-call gate of every kvmesh gRPC server: who the caller is, and whether the table lets it call.

`Guard.admit(full_method, context)` resolves the caller's identity once per call, from
1. the mTLS peer certificate: its one kvmesh URI SAN (``spiffe://kvmesh/<zone>/<role>/<id>``), as grpc
   reports it (`peer_spiffe_id`, else the URI SANs) or, failing that, parsed from the PEM it hands over;
   a certificate naming several kvmesh ids names none;
2. else an ``authorization: Bearer <token>`` metadata entry found in the accepted-tokens file;
then applies `kvmesh.security.authz.decide` (raises Unauthenticated / PermissionDenied, which the handler
wrapper answers with that code). An unknown token is no identity: on an open method the call goes on
(the router checks its own client API keys in that header), on any other it is UNAUTHENTICATED.

`Guard.from_settings(settings)`: `auth_mode` ``off`` → no guard (anyone may call anything, the behaviour
before the table); ``enforce`` → always; ``auto`` (default) → when the server has an identity source, an
accepted-tokens file or mTLS (`tls_client_ca`). So a server started with no auth settings stays open, and
every server `kvmesh up` starts (which always provisions tokens) is guarded.
"""

from __future__ import annotations

import inspect
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from kvmesh.core.errors import FailedPrecondition
from kvmesh.rpc.errors import status_code_for
from kvmesh.security.authz import Policy, decide
from kvmesh.security.certs import spiffe_ids_of_pem
from kvmesh.security.identity import SPIFFE_PREFIX, Identity, identity_var, parse_spiffe_id
from kvmesh.security.tokens import TokenTable, bearer_of
from kvmesh.telemetry import metrics

AUTH_MODES = ("auto", "enforce", "off")
_CACHE_MAX = 4096


class AuthSettings(Protocol):
    """The `ServerSettings` fields a guard is built from."""

    @property
    def auth_mode(self) -> str: ...
    @property
    def auth_tokens_file(self) -> str: ...
    @property
    def auth_clients_generate(self) -> bool: ...
    @property
    def tls_client_ca(self) -> str: ...


def _one_kvmesh_id(values: list[str]) -> Identity | None:
    ids = {v for v in values if v.startswith(SPIFFE_PREFIX)}
    if len(ids) != 1:
        return None
    try:
        return parse_spiffe_id(ids.pop())
    except ValueError:
        return None


@dataclass
class Guard:
    """Identity resolution and the table's decision for one server (see the module docstring)."""

    tokens: TokenTable
    policy: Policy
    service: str = ""
    mtls: bool = False  # clients present verified certificates: look for a kvmesh identity in them

    def __post_init__(self) -> None:
        self._by_pem: dict[bytes, Identity | None] = {}

    @classmethod
    def from_settings(cls, settings: AuthSettings, service: str = "") -> Guard | None:
        mode = settings.auth_mode
        if mode not in AUTH_MODES:
            raise FailedPrecondition(f"auth_mode must be one of {', '.join(AUTH_MODES)}, got {mode!r}")
        if mode == "off" or (mode == "auto" and not (settings.auth_tokens_file or settings.tls_client_ca)):
            return None
        tokens = TokenTable.load(settings.auth_tokens_file) if settings.auth_tokens_file else TokenTable({})
        policy = Policy(clients_generate=settings.auth_clients_generate)
        return cls(tokens, policy, service, mtls=bool(settings.tls_client_ca))

    def identify_peer(self, auth: dict[str, list[bytes]]) -> Identity | None:
        """The identity of an mTLS peer from grpc's auth context (None: no kvmesh certificate)."""
        pem = (auth.get("x509_pem_cert") or [b""])[0]
        if not pem:
            return None
        if pem in self._by_pem:
            return self._by_pem[pem]
        spiffe = auth.get("peer_spiffe_id") or auth.get("peer_uri") or auth.get("x509_subject_alternative_name")
        found = _one_kvmesh_id([v.decode(errors="replace") for v in spiffe or ()])
        if found is None:
            found = _one_kvmesh_id(spiffe_ids_of_pem(pem))
        if len(self._by_pem) >= _CACHE_MAX:
            self._by_pem.clear()
        self._by_pem[pem] = found
        return found

    def identify(self, context: grpc.aio.ServicerContext) -> Identity | None:
        """The caller of this call: its certificate's identity, else its bearer token's, else None."""
        if self.mtls:
            found = self.identify_peer(context.auth_context() or {})
            if found is not None:
                return found
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str):
                return self.tokens.identity(bearer_of(value))
        return None

    def identify_connection(self, der_cert: bytes | None, authorization: str) -> Identity | None:
        """The caller on a connection that is not a gRPC call (the worker's generate frames): its verified
        certificate's identity (DER, as `ssl` hands it over), else its bearer token's, else None."""
        if self.mtls and der_cert:
            found = self.identify_peer({"x509_pem_cert": [ssl.DER_cert_to_PEM_cert(der_cert).encode()]})
            if found is not None:
                return found
        return self.tokens.identity(bearer_of(authorization)) if authorization else None

    def admit(self, full_method: str, context: grpc.aio.ServicerContext) -> Identity | None:
        """The caller's identity if the table lets it call `full_method`; raises Unauthenticated /
        PermissionDenied (counted in `kvmesh_authz_denied_total`) otherwise."""
        return self.admit_identity(full_method, self.identify(context))

    def admit_identity(self, full_method: str, identity: Identity | None) -> Identity | None:
        """`admit` for an identity already resolved."""
        try:
            decide(self.policy.grpc_rule(full_method), identity, full_method)
        except Exception:
            role = identity.role.value if identity else "anonymous"
            metrics.AUTHZ_DENIED.labels(self.service, full_method, role).inc()
            raise
        return identity


def guarded_handler(full_method: str, handler: grpc.RpcMethodHandler, guard: Guard) -> grpc.RpcMethodHandler:
    """`handler` behind `guard`, for handlers `kvmesh.rpc.interceptors` does not wrap (health, reflection):
    a refused call is aborted with the code and the message naming role and method."""

    async def check(context: grpc.aio.ServicerContext) -> None:
        try:
            identity_var.set(guard.admit(full_method, context))
        except Exception as exc:
            await context.abort(status_code_for(exc), str(exc))

    def unary(inner: Callable[..., Any]) -> Callable[..., Any]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            return await inner(request, context)

        return handle

    def stream(inner: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(inner):  # writes with context.write (grpc health's Watch)
            return unary(inner)

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            async for item in inner(request, context):
                yield item

        return handle

    de, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), de, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), de, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), de, ser)
    return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), de, ser)


class _GuardedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler, guard: Guard) -> None:
        self._inner, self._guard = inner, guard

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._inner.service(handler_call_details)
        full: str = handler_call_details.method  # type: ignore[attr-defined]
        return None if handler is None else guarded_handler(full, handler, self._guard)


class GuardedServer:
    """What `add_*_to_server` / `enable_server_reflection` are given instead of the server, for grpc's own
    services: their handlers registered behind `guard`."""

    def __init__(self, server: grpc.aio.Server, guard: Guard) -> None:
        self._server, self._guard = server, guard

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h, self._guard) for h in handlers))

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict[str, Any]) -> None:
        wrapped = {n: guarded_handler(f"/{service_name}/{n}", h, self._guard) for n, h in method_handlers.items()}
        self._server.add_registered_method_handlers(service_name, wrapped)  # type: ignore[attr-defined]
