"""The authorisation table on a service's HTTP server: an aiohttp middleware (`ServiceRunner` installs it).

The caller's identity is, over HTTPS, the kvmesh client certificate it presented (optional there: an OpenAI
client has a key, not a certificate), else its ``Authorization: Bearer <token>`` found in the accepted-tokens
file, as on gRPC (`Guard.identify_connection`); the route's rule (`kvmesh.security.authz.HTTP_RULES`, by
service, method and path) decides as for gRPC. A refusal is answered in the OpenAI error shape: 401 without an
identity, 403 naming the role and the route. A path the server has no route for is 404 to every caller, as on
any HTTP server (a wrong method on a known path: 405), never a refusal that would suggest a credential could
help; a route the server has but the table lacks stays denied to everyone. An open route (the router's
``/v1/*`` client API and vLLM's probes, ``/metrics``, ``/healthz``) lets an unknown token through: on the
router it is a client API key, which the router's own key check (`services/router/auth.py`) decides. The
identity is in `identity_var` for the handler.
"""

from __future__ import annotations

from aiohttp import web

from kvmesh.core.errors import KvmeshError, NotFound
from kvmesh.openai.aio import Handler, error_response
from kvmesh.rpc.auth import Guard
from kvmesh.security.authz import decide
from kvmesh.security.identity import identity_var
from kvmesh.telemetry import metrics


def _peer_certificate(request: web.Request) -> bytes | None:
    """The verified client certificate of an HTTPS connection (DER), None over plain HTTP or without one."""
    tls = request.transport.get_extra_info("ssl_object") if request.transport is not None else None
    return tls.getpeercert(binary_form=True) if tls is not None else None


def http_guard(guard: Guard) -> web.middleware:  # type: ignore[valid-type]
    """The middleware enforcing `guard`'s table on the routes of the service `guard.service`."""

    @web.middleware
    async def authorize(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = f"{request.method} {request.path}"
        rule = guard.policy.http_rule(guard.service, request.method, request.path)
        unrouted = request.match_info.http_exception  # aiohttp's 404 / 405: no handler of this server
        if rule is None and unrouted is not None:
            if isinstance(unrouted, web.HTTPNotFound):
                return error_response(NotFound(f"no route {route}"))
            return await handler(request)  # raises the 405, naming the methods the path has
        identity = guard.identify_connection(_peer_certificate(request), request.headers.get("Authorization", ""))
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
