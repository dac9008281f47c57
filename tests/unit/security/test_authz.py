"""The authorisation table covers every RPC and route there is, decides as documented, and docs/security.md
shows it as it is; tokens files and certificates parse into identities (or fail naming what is wrong)."""

from __future__ import annotations

import importlib
import pkgutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

import kvmesh.v1
from kvmesh.core.config import ServerSettings
from kvmesh.core.errors import FailedPrecondition, PermissionDenied, Unauthenticated
from kvmesh.rpc.auth import Guard
from kvmesh.security import authz
from kvmesh.security.authz import GRPC_RULES, HTTP_RULES, Policy, decide
from kvmesh.security.certs import make_dev_pki, spiffe_ids_of_pem
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.security.tokens import TokenTable, bearer_of, digest, provision, read_own_token
from kvmesh.services.router.http_api import HttpApi
from kvmesh.services.worker.openai_http import OpenAIApi

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
R = CallerRole


def _proto_methods() -> set[str]:
    """Every RPC of the generated kvmesh.v1 descriptors, plus grpc health and reflection (v1alpha)."""
    found = set()
    for mod in pkgutil.iter_modules(kvmesh.v1.__path__):
        if mod.name.endswith("_pb2"):
            descriptor = importlib.import_module(f"kvmesh.v1.{mod.name}").DESCRIPTOR
            for service in descriptor.services_by_name.values():
                found |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    for descriptor in (health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
        for service in descriptor.services_by_name.values():
            found |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    return found


def test_every_rpc_in_the_descriptors_has_exactly_one_row() -> None:
    methods = _proto_methods()
    assert len(methods) >= 34  # 30 kvmesh RPCs, grpc health (3) and reflection (v1alpha, served)
    assert sorted(methods - set(GRPC_RULES)) == []  # a new RPC without a row is denied to everyone: add one
    assert sorted(set(GRPC_RULES) - methods) == []  # no row for an RPC that no longer exists


def _routes(app: web.Application) -> set[tuple[str, str]]:
    return {(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD" and r.resource}


def test_every_http_route_of_every_service_has_a_row() -> None:
    router, worker = web.Application(), web.Application()
    HttpApi(None, 1024).install(router)  # type: ignore[arg-type]  # installing binds handlers, nothing more
    OpenAIApi(None, "m").add_routes(worker)  # type: ignore[arg-type]
    common = {("GET", "/metrics"), ("GET", "/healthz")}  # ServiceRunner's own
    policy = Policy()
    for service, routes in (("router", _routes(router)), ("worker", _routes(worker))):
        for method, path in routes | common:
            assert policy.http_rule(service, method, path) is not None, (service, method, path)
    for service in ("cache-manager", "failover"):
        for method, path in common:
            assert policy.http_rule(service, method, path) is not None
    listed = {(s, m, p) for (s, m, p) in HTTP_RULES if s != authz.ANY_SERVICE}
    real = {("router", m, p) for m, p in _routes(router)} | {("worker", m, p) for m, p in _routes(worker)}
    assert listed == real  # no row for a route that is gone


def test_the_issue_s_grants() -> None:
    g = GRPC_RULES
    assert g["/kvmesh.v1.CacheManagerService/PublishKvEvents"].roles == {R.WORKER}
    assert g["/kvmesh.v1.CacheManagerService/ReportRoutedPrefixes"].roles == {R.ROUTER}  # feeds the statistics
    # another zone's cache-manager replicating: its names are dialled by this zone's workers
    assert g["/kvmesh.v1.CacheManagerService/ReplicatePrefixes"].roles == {R.CACHE_MANAGER}
    # it leases a replicated prefix next to its source worker, for the other zone's worker to read under; it
    # never reads KV bytes itself
    assert g["/kvmesh.v1.KvSyncService/AcquireLease"].roles == {R.WORKER, R.PEER_ZONE, R.CACHE_MANAGER}
    for m in ("Describe", "ReadBlocks", "WriteBlocks"):
        assert g[f"/kvmesh.v1.KvSyncService/{m}"].roles == {R.WORKER, R.PEER_ZONE}
    for m in ("/kvmesh.v1.CacheManagerService/FindMatches", "/kvmesh.v1.WorkerService/StreamKvEvents"):
        assert g[m].roles == {R.ROUTER, R.CACHE_MANAGER} and not g[m].open
    for m in ("DrainWorker", "ListWorkers"):  # the planner reads the workers and drains before a scale-in
        assert g[f"/kvmesh.v1.RouterAdminService/{m}"].roles == {R.ADMIN, R.PLANNER}
    assert {m for m, r in g.items() if R.PLANNER in r.roles and not r.open} == {
        "/kvmesh.v1.RouterAdminService/DrainWorker",
        "/kvmesh.v1.RouterAdminService/ListWorkers",
    }
    admin_only = ["/kvmesh.v1.RouterAdminService/Rebalance"]
    admin_only += [f"/kvmesh.v1.CacheManagerService/{m}" for m in ("SetWarmingPolicy", "Checkpoint", "Restore")]
    admin_only += [f"/kvmesh.v1.FailoverService/{m}" for m in ("SetTrafficWeights", "RollbackTrafficWeights")]
    for m in admin_only:
        assert g[m].roles == {R.ADMIN} and not g[m].open, m
    for (_svc, _method, path), rule in HTTP_RULES.items():
        if path.startswith("/admin/"):
            assert rule.roles == {R.ADMIN} and not rule.open
    assert R.CLIENT not in g["/kvmesh.v1.WorkerService/Generate"].roles
    assert R.CLIENT in Policy(clients_generate=True).grpc_rule("/kvmesh.v1.WorkerService/Generate").roles  # type: ignore[union-attr]
    opens = sorted(m for m, r in g.items() if r.open)
    assert opens == [
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/List",
        "/grpc.health.v1.Health/Watch",
        "/kvmesh.v1.FailoverService/WatchEndpoints",
        "/kvmesh.v1.RouterService/Generate",
    ]


def test_decide_denies_by_default_and_names_role_and_method() -> None:
    method = "/kvmesh.v1.CacheManagerService/FindMatches"
    worker = Identity(R.WORKER, "w1")
    with pytest.raises(PermissionDenied, match=f"role worker may not call {method}"):
        decide(GRPC_RULES[method], worker, method)
    with pytest.raises(Unauthenticated, match=method):
        decide(GRPC_RULES[method], None, method)
    with pytest.raises(PermissionDenied, match="no row"):
        decide(None, Identity(R.ADMIN, "op"), "/kvmesh.v1.Nope/Nothing")
    decide(GRPC_RULES[method], Identity(R.ROUTER, "r"), method)
    report = "/kvmesh.v1.CacheManagerService/ReportRoutedPrefixes"
    decide(GRPC_RULES[report], Identity(R.ROUTER, "r"), report)
    for role in set(R) - {R.ROUTER}:
        with pytest.raises(PermissionDenied, match=f"role {role.value} may not call {report}"):
            decide(GRPC_RULES[report], Identity(role, "x"), report)
    decide(GRPC_RULES["/kvmesh.v1.RouterService/Generate"], None, "x")  # open: the router checks API keys


def test_docs_show_the_table_as_it_is() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_security_table.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert authz.markdown() in (ROOT / "docs" / "security.md").read_text()


def test_tokens_provisioned_private_and_resolved_by_digest(tmp_path: Path) -> None:
    w = Identity(R.WORKER, "worker-local-0", "local")
    c = Identity(R.CLIENT, "alice", "local", ("alice", "alice-eval"))
    files = provision(tmp_path / "auth", [w, c])
    table = TokenTable.load(str(tmp_path / "auth" / "tokens.yaml"))
    assert table.identity(read_own_token(str(files[w]))) == w
    assert table.identity(read_own_token(str(files[c]))) == c  # tenants travel with the identity
    assert table.identity("not-a-token") is None and table.identity(None) is None
    text = (tmp_path / "auth" / "tokens.yaml").read_text()
    assert read_own_token(str(files[w])) not in text and digest(read_own_token(str(files[w]))) in text
    for path in [tmp_path / "auth" / "tokens.yaml", *files.values()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert stat.S_IMODE((tmp_path / "auth").stat().st_mode) == 0o700


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("tokens: 3", "`tokens` list"),
        ("tokens: [{identity: 'spiffe://kvmesh/z/worker/w'}]", r"tokens\[0\]: want sha256 or token"),
        ("tokens: [{sha256: abc, identity: 'spiffe://kvmesh/z/worker/w'}]", "64 hex digits"),
        ("tokens: [{token: t, identity: 'spiffe://kvmesh/z/boss/w'}]", "unknown role 'boss'"),
        ("tokens: [{token: t, identity: 'spiffe://kvmesh/z/client/c', tenants: [1]}]", "tenants"),
        ("tokens: [: :", "not YAML"),
    ],
)
def test_bad_tokens_file_fails_naming_the_entry(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text(content)
    with pytest.raises(FailedPrecondition, match=message):
        TokenTable.load(str(path))


def test_bearer_header_parsing() -> None:
    assert bearer_of("Bearer abc") == "abc" and bearer_of("bearer  abc ") == "abc"
    assert bearer_of("Basic abc") is None and bearer_of("Bearer ") is None and bearer_of(None) is None


def test_guard_modes() -> None:
    assert Guard.from_settings(ServerSettings()) is None  # nothing configured: open, as before the table
    assert Guard.from_settings(ServerSettings(auth_mode="enforce")) is not None
    assert Guard.from_settings(ServerSettings(auth_mode="off", tls_client_ca="ca.pem")) is None
    assert Guard.from_settings(ServerSettings(tls_client_ca="ca.pem")) is not None  # mTLS: enforced
    with pytest.raises(FailedPrecondition, match="auth_mode"):
        Guard.from_settings(ServerSettings(auth_mode="strict"))


def test_dev_certificates_carry_the_spiffe_id(tmp_path: Path) -> None:
    ident = Identity(R.CACHE_MANAGER, "cm-1", "eu-1")
    pki = make_dev_pki(tmp_path / "pki", [ident])
    pem = pki.pairs[ident].cert.read_bytes()
    assert spiffe_ids_of_pem(pem) == ["spiffe://kvmesh/eu-1/cache-manager/cm-1"]
    guard = Guard(TokenTable({}), Policy(), mtls=True)
    assert guard.identify_peer({"x509_pem_cert": [pem]}) == ident  # parsed from the PEM when grpc gives no SAN
    assert stat.S_IMODE(pki.pairs[ident].key.stat().st_mode) == 0o600
    assert spiffe_ids_of_pem(b"garbage") == []
