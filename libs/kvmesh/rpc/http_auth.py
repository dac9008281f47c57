"""The authorisation table on a service's HTTP server: an aiohttp middleware (`ServiceRunner` installs it).

The caller's identity is its ``Authorization: Bearer <token>`` found in the accepted-tokens file (the HTTP
servers have no TLS of their own); the route's rule (`kvmesh.security.authz.HTTP_RULES`, by service,
method and path) decides as for gRPC. A refusal is answered in the OpenAI error shape: 401 without an
identity, 403 naming the role and the route. An open route (the router's ``/v1/*`` client API,
``/metrics``, ``/healthz``) lets an unknown token through: on the router it is a client API key, which
the router's own key check (`services/router/auth.py`) decides. The identity is in `identity_var` for the
handler.
"""

from __future__ import annotations

from aiohttp import web

from kvmesh.core.errors import KvmeshError
from kvmesh.openai.aio import Handler, error_response
from kvmesh.rpc.auth import Guard
from kvmesh.security.authz import decide
from kvmesh.security.identity import identity_var
from kvmesh.security.tokens import bearer_of
from kvmesh.telemetry import metrics


def http_guard(guard: Guard) -> web.middleware:  # type: ignore[valid-type]
    """The middleware enforcing `guard`'s table on the routes of the service `guard.service`."""

    @web.middleware
    async def authorize(request: web.Request, handler: Handler) -> web.StreamResponse:
        identity = guard.tokens.identity(bearer_of(request.headers.get("Authorization")))
        route = f"{request.method} {request.path}"
        rule = guard.policy.http_rule(guard.service, request.method, request.path)
        try:
            decide(rule, identity, route)
        except KvmeshError as exc:
            role = identity.role.value if identity else "anonymous"
            label = route if rule is not None else "unlisted"  # bounded: any path may be asked for
            metrics.AUTHZ_DENIED.labels(guard.service, label, role).inc()
            return error_response(exc)
        token = identity_var.set(identity)
        try:
            return await handler(request)
        finally:
            identity_var.reset(token)

    return authorize
