"""Every cell of the authorisation table, enforced by a real `ServiceRunner` over real sockets.

One in-process server serves every kvmesh gRPC service (the generated base servicers: an admitted call gets as
far as the handler, which answers UNIMPLEMENTED) with mTLS from `kvmesh certs`; a call is made per (method,
role) with that role's certificate: denied cells answer PERMISSION_DENIED naming role and method, allowed
ones reach the handler. The cases are generated from the table itself, so a new row is covered. A second,
plaintext server with provisioned tokens checks the anonymous column (UNAUTHENTICATED unless open) and that
tokens give the same identities; HTTP routes are checked per service the same way.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import pkgutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

import kvmesh.v1
from kvmesh.core.config import ServerSettings
from kvmesh.rpc.channel import ChannelSecurity, open_channel
from kvmesh.rpc.server import ServiceRunner
from kvmesh.security.authz import ANY_SERVICE, GRPC_RULES, HTTP_RULES
from kvmesh.security.identity import CallerRole, Identity, current_identity
from kvmesh.security.tokens import accepted_file, provision, read_own_token
from kvmesh.v1 import (
    cache_manager_pb2,
    cache_manager_pb2_grpc,
    failover_pb2_grpc,
    kvsync_pb2,
    kvsync_pb2_grpc,
    planner_pb2_grpc,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

pytestmark = pytest.mark.integration
T = TypeVar("T")
ROLES = list(CallerRole)
UNLISTED = ("POST", "/admin/unlisted")
DENIED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


def _kinds() -> dict[str, tuple[bool, bool]]:
    """(client streaming, server streaming) of every method, from the descriptors."""
    out = {}
    descriptors = [health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR]
    for mod in pkgutil.iter_modules(kvmesh.v1.__path__):
        if mod.name.endswith("_pb2"):
            descriptors.append(importlib.import_module(f"kvmesh.v1.{mod.name}").DESCRIPTOR)
    for d in descriptors:
        for service in d.services_by_name.values():
            for m in service.methods:
                out[f"/{service.full_name}/{m.name}"] = (m.client_streaming, m.server_streaming)
    return out


KINDS = _kinds()


class _Worker(worker_pb2_grpc.WorkerServiceServicer):
    """GetInfo answers with the caller's identity as the handler sees it (`current_identity()`)."""

    async def GetInfo(self, request: Any, context: Any) -> worker_pb2.GetInfoResponse:
        ident = current_identity()
        return worker_pb2.GetInfoResponse(worker_id=ident.spiffe_id if ident else "")


SERVICERS: list[tuple[Callable[[Any, Any], None], Any, str]] = [
    (
        cache_manager_pb2_grpc.add_CacheManagerServiceServicer_to_server,
        cache_manager_pb2_grpc.CacheManagerServiceServicer(),
        "kvmesh.v1.CacheManagerService",
    ),
    (
        failover_pb2_grpc.add_FailoverServiceServicer_to_server,
        failover_pb2_grpc.FailoverServiceServicer(),
        "kvmesh.v1.FailoverService",
    ),
    (
        kvsync_pb2_grpc.add_KvSyncServiceServicer_to_server,
        kvsync_pb2_grpc.KvSyncServiceServicer(),
        "kvmesh.v1.KvSyncService",
    ),
    (
        router_pb2_grpc.add_RouterServiceServicer_to_server,
        router_pb2_grpc.RouterServiceServicer(),
        "kvmesh.v1.RouterService",
    ),
    (
        router_pb2_grpc.add_RouterAdminServiceServicer_to_server,
        router_pb2_grpc.RouterAdminServiceServicer(),
        "kvmesh.v1.RouterAdminService",
    ),
    (worker_pb2_grpc.add_WorkerServiceServicer_to_server, _Worker(), "kvmesh.v1.WorkerService"),
    (
        planner_pb2_grpc.add_PlannerServiceServicer_to_server,
        planner_pb2_grpc.PlannerServiceServicer(),
        "kvmesh.v1.PlannerService",
    ),
]


class _Loop:
    """An event loop in a thread, for in-process servers the synchronous test clients call."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.loop.close()


@dataclass
class Env:
    address: str  # mTLS server
    plain: str  # token server
    http: dict[str, int]  # service -> HTTP port (token servers)
    certs: dict[CallerRole, grpc.ChannelCredentials]
    tokens: dict[CallerRole, str]


def _identities() -> dict[CallerRole, Identity]:
    return {r: Identity(r, "t-" + r.value, "local") for r in ROLES}


async def _start(
    name: str, settings: ServerSettings, grpc_services: bool, routes: list[tuple[str, str]]
) -> ServiceRunner:
    runner = ServiceRunner(name, settings)
    if grpc_services:
        for add, servicer, full in SERVICERS:
            runner.add_servicer(add, servicer, full)

    async def ok(_request: web.Request) -> web.Response:
        return web.json_response({"ident": str(current_identity())})

    for method, path in routes:
        runner.http_app.router.add_route(method, path, ok)
    await runner.start()
    return runner


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("authz")
    made = subprocess.run(
        [sys.executable, "-m", "kvmesh.suite.cli", "certs", str(tmp / "pki"), "--workers", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    pki = tmp / "pki"
    # `kvmesh certs` writes a pair per identity of a suite: one per role (worker: worker-local-0)
    stems = {
        CallerRole.CLIENT: "client-demo",
        CallerRole.ADMIN: "admin-operator",
        CallerRole.ROUTER: "router-router-local",
        CallerRole.WORKER: "worker-worker-local-0",
        CallerRole.CACHE_MANAGER: "cache-manager-cache-manager-local",
        CallerRole.FAILOVER: "failover-failover-local",
        CallerRole.PEER_ZONE: "peer-zone-peer-of-local",
        CallerRole.PLANNER: "planner-planner-local",
    }
    ca = (pki / "ca.pem").read_bytes()
    certs = {
        r: grpc.ssl_channel_credentials(ca, (pki / f"{s}.key").read_bytes(), (pki / f"{s}.pem").read_bytes())
        for r, s in stems.items()
    }
    files = provision(tmp / "auth", list(_identities().values()))
    tokens = {i.role: read_own_token(str(p)) for i, p in files.items()}
    mtls = ServerSettings(
        http_port=-1,
        grace_s=0.2,
        tls_cert=str(pki / "router-router-local.pem"),
        tls_key=str(pki / "router-router-local.key"),
        tls_client_ca=str(pki / "ca.pem"),
    )
    plain = ServerSettings(grace_s=0.2, auth_tokens_file=str(accepted_file(tmp / "auth")))
    loop = _Loop()
    by_service: dict[str, list[tuple[str, str]]] = {"router": [], "worker": [], "cache-manager": []}
    for service, method, path in HTTP_RULES:
        if service != ANY_SERVICE:
            by_service[service].append((method, path))
    runners = [loop.run(_start("all", mtls, True, []))]
    # one route the server has and the table lacks: denied to everyone (a path it has no route for is 404)
    runners.append(loop.run(_start("router", plain, True, [*by_service["router"], UNLISTED])))
    runners += [loop.run(_start(s, plain, False, by_service[s])) for s in ("worker", "cache-manager")]
    ports = [r.ports for r in runners]
    assert all(p is not None for p in ports)
    http = {r.name: r.ports.http_port for r in runners[1:] if r.ports and r.ports.http_port}
    try:
        yield Env(
            f"127.0.0.1:{ports[0].grpc_port}",  # type: ignore[union-attr]
            f"127.0.0.1:{ports[1].grpc_port}",  # type: ignore[union-attr]
            http,
            certs,
            tokens,
        )
    finally:
        for r in runners:
            loop.run(r.drain_and_stop())
        loop.close()


def _call(channel: grpc.Channel, method: str, metadata: tuple[tuple[str, str], ...] = ()) -> grpc.RpcError | None:
    """One call of `method` with an empty request (raw bytes): its error, or None when it succeeded."""
    client_streaming, server_streaming = KINDS[method]
    kind = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[(client_streaming, server_streaming)]
    call = kind(method, request_serializer=None, response_deserializer=None)
    request: Any = iter([b""]) if client_streaming else b""
    try:
        if server_streaming:
            it = call(request, timeout=10, metadata=metadata)
            next(it, None)  # the first message (health Watch would stream on)
            it.cancel()
        else:
            call(request, timeout=10, metadata=metadata)
    except grpc.RpcError as err:
        return err
    return None


@pytest.fixture(scope="module")
def channels(env: Env) -> Iterator[dict[CallerRole, grpc.Channel]]:
    chans = {r: grpc.secure_channel(env.address, c) for r, c in env.certs.items()}
    yield chans
    for c in chans.values():
        c.close()


def _code(err: grpc.RpcError | None) -> grpc.StatusCode:
    return grpc.StatusCode.OK if err is None else err.code()  # type: ignore[no-any-return]


CELLS = [(m, r) for m in GRPC_RULES for r in ROLES]


@pytest.mark.parametrize(
    ("method", "role"),
    CELLS,
    ids=[f"{m.rsplit('/', 2)[-2].split('.')[-1]}.{m.rsplit('/', 1)[-1]}-{r.value}" for m, r in CELLS],
)
def test_grpc_cell_over_mtls(channels: dict[CallerRole, grpc.Channel], method: str, role: CallerRole) -> None:
    err = _call(channels[role], method)
    if role in GRPC_RULES[method].roles:
        assert _code(err) not in DENIED, err  # reached the handler (UNIMPLEMENTED, or an answer)
    else:
        assert _code(err) == grpc.StatusCode.PERMISSION_DENIED, err
        assert f"role {role.value} may not call {method}" in err.details()  # type: ignore[union-attr]


@pytest.mark.parametrize("method", list(GRPC_RULES))
def test_grpc_anonymous_cell(env: Env, method: str) -> None:
    with grpc.insecure_channel(env.plain) as ch:
        err = _call(ch, method)
        if GRPC_RULES[method].open:
            assert _code(err) not in DENIED, err
        else:
            assert _code(err) == grpc.StatusCode.UNAUTHENTICATED, err
            assert method in err.details()  # type: ignore[union-attr]


def test_the_handler_sees_the_caller_identity(env: Env, channels: dict[CallerRole, grpc.Channel]) -> None:
    info = "/kvmesh.v1.WorkerService/GetInfo"
    stub = worker_pb2_grpc.WorkerServiceStub(channels[CallerRole.ROUTER])
    assert (
        stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10).worker_id == "spiffe://kvmesh/local/router/router-local"
    )
    with grpc.insecure_channel(env.plain) as ch:
        by_token = worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(
            worker_pb2.GetInfoRequest(), metadata=(("authorization", f"Bearer {env.tokens[CallerRole.ADMIN]}"),)
        )
        assert by_token.worker_id == "spiffe://kvmesh/local/admin/t-admin"
        worker = (("authorization", f"Bearer {env.tokens[CallerRole.WORKER]}"),)
        assert _code(_call(ch, info, worker)) == grpc.StatusCode.PERMISSION_DENIED
        unknown = (("authorization", "Bearer not-a-provisioned-token"),)
        assert _code(_call(ch, info, unknown)) == grpc.StatusCode.UNAUTHENTICATED
        # an unknown token on an open method is no identity: the call goes on (the router checks API keys)
        assert _code(_call(ch, "/kvmesh.v1.RouterService/Generate", unknown)) == grpc.StatusCode.UNIMPLEMENTED


def _http(port: int, method: str, path: str, token: str | None) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", method=method, data=b"{}" if method == "POST" else None
    )
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            body = resp.read()
            return resp.status, json.loads(body) if resp.headers.get_content_type() == "application/json" else {}
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


HTTP_CELLS = [
    (svc if svc != ANY_SERVICE else s, m, p, r)
    for (svc, m, p) in HTTP_RULES
    for s in ((svc,) if svc != ANY_SERVICE else ("router", "cache-manager"))
    for r in [*ROLES, None]
]


@pytest.mark.parametrize(
    ("service", "method", "path", "role"),
    HTTP_CELLS,
    ids=[f"{s}-{m}{p}-{r.value if r else 'anonymous'}" for s, m, p, r in HTTP_CELLS],
)
def test_http_cell(env: Env, service: str, method: str, path: str, role: CallerRole | None) -> None:
    rule = HTTP_RULES.get((service, method, path)) or HTTP_RULES[(ANY_SERVICE, method, path)]
    status, body = _http(env.http[service], method, path, env.tokens[role] if role else None)
    if (role is None and rule.open) or (role is not None and role in rule.roles):
        assert status == 200, (status, body)
    elif role is None:
        assert status == 401 and f"{method} {path}" in body["error"]["message"], body
    else:
        assert status == 403, (status, body)
        assert f"role {role.value} may not call {method} {path}" in body["error"]["message"]


def test_http_route_in_no_row_is_denied(env: Env) -> None:
    status, body = _http(env.http["router"], *UNLISTED, env.tokens[CallerRole.ADMIN])
    assert status == 403 and "no row" in body["error"]["message"]


@pytest.mark.parametrize("role", [CallerRole.ADMIN, CallerRole.CLIENT, None], ids=lambda r: r.value if r else "anon")
def test_a_path_without_a_route_is_404_for_every_caller(env: Env, role: CallerRole | None) -> None:
    """Not 403: no credential would help; a wrong method on a route's path is 405, before any credential."""
    token = env.tokens[role] if role else None
    status, body = _http(env.http["router"], "GET", "/v1/no-such-route", token)
    assert status == 404 and body["error"]["message"] == "no route GET /v1/no-such-route", body
    req = urllib.request.Request(f"http://127.0.0.1:{env.http['router']}/admin/drain", method="GET")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 405


async def test_open_channel_sends_the_own_token_on_every_call_kind(env: Env) -> None:
    """`open_channel` with a token: unary, server-, client- and bidi-streaming calls all carry it (the server
    admits them by it), with and without the propagating interceptor."""
    worker, router = ChannelSecurity(token=env.tokens[CallerRole.WORKER]), env.tokens[CallerRole.ROUTER]
    for propagate in (True, False):
        async with open_channel(env.plain, ChannelSecurity(token=router), propagate=propagate) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await cache_manager_pb2_grpc.CacheManagerServiceStub(ch).GetStats(cache_manager_pb2.GetStatsRequest())
            assert unary.value.code() == grpc.StatusCode.UNIMPLEMENTED  # admitted: reached the handler
            events = worker_pb2_grpc.WorkerServiceStub(ch).StreamKvEvents(worker_pb2.StreamKvEventsRequest())
            with pytest.raises(grpc.aio.AioRpcError) as server_stream:
                await events.read()
            assert server_stream.value.code() == grpc.StatusCode.UNIMPLEMENTED
        async with open_channel(env.plain, worker, propagate=propagate) as ch:
            publish = cache_manager_pb2_grpc.CacheManagerServiceStub(ch).PublishKvEvents()
            with pytest.raises(grpc.aio.AioRpcError) as bidi:
                await publish.read()
            assert bidi.value.code() == grpc.StatusCode.UNIMPLEMENTED
            write = kvsync_pb2_grpc.KvSyncServiceStub(ch).WriteBlocks(iter([kvsync_pb2.WriteBlocksRequest()]))
            with pytest.raises(grpc.aio.AioRpcError) as client_stream:
                await write
            assert client_stream.value.code() == grpc.StatusCode.UNIMPLEMENTED
    async with open_channel(env.plain) as ch:  # no token: the same calls are anonymous
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            await cache_manager_pb2_grpc.CacheManagerServiceStub(ch).GetStats(cache_manager_pb2.GetStatsRequest())
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
