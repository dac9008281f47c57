"""The authorisation table's edge cells: HEAD is decided as GET (aiohttp answers it with the GET handler, so it
must be no more open than GET), and the `clients_generate` flag: off, a client may not call a worker's
generation RPCs or routes; on, it may call exactly those and nothing else more."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import PermissionDenied, Unauthenticated
from kvmesh.security.authz import ANY_SERVICE, GRPC_RULES, HTTP_RULES, Policy, Rule, decide
from kvmesh.security.identity import CallerRole, Identity

pytestmark = pytest.mark.unit
R = CallerRole
CLIENT = Identity(R.CLIENT, "c1", tenants=("t",))
ROUTER = Identity(R.ROUTER, "r1")
OFF = Policy()
ON = Policy(clients_generate=True)
WORKER_GENERATION = tuple(f"/kvmesh.v1.WorkerService/{m}" for m in ("Generate", "GenerateStream", "Abort"))
WORKER_HTTP_GENERATION = (("worker", "POST", "/v1/completions"), ("worker", "POST", "/v1/chat/completions"))


def allowed(rule: Rule | None, who: Identity | None) -> bool:
    try:
        decide(rule, who, "x")
    except (PermissionDenied, Unauthenticated):
        return False
    return True


@pytest.mark.parametrize(("service", "path"), [(s, p) for (s, m, p) in HTTP_RULES if m == "GET"])
def test_head_is_decided_exactly_as_get(service: str, path: str) -> None:
    for policy in (OFF, ON):
        assert policy.http_rule(service, "HEAD", path) == policy.http_rule(service, "GET", path)


def test_head_on_a_worker_probe_is_for_router_and_admin_only() -> None:
    rule = OFF.http_rule("worker", "HEAD", "/health")
    assert rule is not None and allowed(rule, ROUTER) and not allowed(rule, CLIENT) and not allowed(rule, None)
    assert allowed(OFF.http_rule("router", "HEAD", "/metrics"), None)  # the every-service row, via GET
    assert allowed(OFF.http_rule("worker", "HEAD", "/healthz"), None)


def test_head_where_only_post_has_a_row_is_denied() -> None:
    assert OFF.http_rule("router", "HEAD", "/v1/completions") is None
    assert OFF.http_rule("router", "PUT", "/v1/completions") is None
    with pytest.raises(PermissionDenied, match="no row"):
        decide(OFF.http_rule("router", "HEAD", "/v1/completions"), CLIENT, "HEAD /v1/completions")


def test_the_every_service_rows_are_a_fallback_for_any_service() -> None:
    assert (ANY_SERVICE, "GET", "/metrics") in HTTP_RULES
    assert OFF.http_rule("cache-manager", "GET", "/metrics") == HTTP_RULES[(ANY_SERVICE, "GET", "/metrics")]
    assert OFF.http_rule("cache-manager", "GET", "/v1/models") is None  # no fallback for a service's own routes


@pytest.mark.parametrize("method", WORKER_GENERATION)
def test_clients_may_not_generate_on_a_worker_when_the_flag_is_off(method: str) -> None:
    with pytest.raises(PermissionDenied, match=f"role client may not call {method}"):
        decide(OFF.grpc_rule(method), CLIENT, method)
    assert allowed(OFF.grpc_rule(method), ROUTER)


@pytest.mark.parametrize("method", WORKER_GENERATION)
def test_clients_may_generate_on_a_worker_when_the_flag_is_on(method: str) -> None:
    rule = ON.grpc_rule(method)
    assert rule is not None and allowed(rule, CLIENT) and allowed(rule, ROUTER)
    assert rule.roles == GRPC_RULES[method].roles | {R.CLIENT}  # adds the client, removes no one
    assert not rule.open and not allowed(rule, None)  # still needs an identity


@pytest.mark.parametrize("key", WORKER_HTTP_GENERATION)
def test_worker_http_generation_follows_the_flag(key: tuple[str, str, str]) -> None:
    service, method, path = key
    assert not allowed(OFF.http_rule(service, method, path), CLIENT)
    rule = ON.http_rule(service, method, path)
    assert rule is not None and allowed(rule, CLIENT) and allowed(rule, ROUTER)
    assert rule.roles == HTTP_RULES[key].roles | {R.CLIENT} and not rule.open


def test_the_flag_opens_nothing_else_to_clients() -> None:
    widened = {m for m in GRPC_RULES if R.CLIENT in (ON.grpc_rule(m) or Rule(frozenset())).roles}
    assert widened - set(WORKER_GENERATION) == {"/kvmesh.v1.RouterService/Generate"} | {
        m for m, r in GRPC_RULES.items() if r.open
    }
    for m in ("/kvmesh.v1.WorkerService/StreamLoad", "/kvmesh.v1.WorkerService/GetInfo"):
        assert ON.grpc_rule(m) == GRPC_RULES[m] and not allowed(ON.grpc_rule(m), CLIENT)
    assert not allowed(ON.http_rule("worker", "GET", "/v1/models"), CLIENT)
    assert not allowed(ON.http_rule("worker", "GET", "/health"), CLIENT)
    assert ON.grpc_rule("/kvmesh.v1.Nope/Nothing") is None and ON.http_rule("worker", "POST", "/nope") is None


def test_an_open_rule_admits_anonymous_callers_and_every_role() -> None:
    rule = GRPC_RULES["/grpc.health.v1.Health/Check"]
    assert rule.open and rule.roles == frozenset(R) and rule.describe() == "anyone"
    assert all(allowed(rule, Identity(role, "x")) for role in R) and allowed(rule, None)
    router_api = GRPC_RULES["/kvmesh.v1.RouterService/Generate"]
    assert router_api.describe() == "anyone (client, admin by role)"
    assert allowed(router_api, None) and not allowed(router_api, ROUTER)
    assert GRPC_RULES["/kvmesh.v1.WorkerService/StreamLoad"].describe() == "router, failover"
