"""The authorisation table: which roles may call each gRPC method and HTTP route of every kvmesh service.

One table, enforced by the shared server skeleton (`kvmesh.rpc.server.ServiceRunner`) on every service:
- `GRPC_RULES[full method]`, e.g. ``/kvmesh.v1.CacheManagerService/PublishKvEvents`` → a `Rule`;
- `HTTP_RULES[(service, method, path)]`, service ``*`` for the routes every service has (``/metrics``,
  ``/healthz``).

A `Rule` names the roles allowed; `open` rules also admit anonymous callers (grpc health, the router's
client API whose API keys the router itself checks, the failover service's endpoint watch that
`kvmesh.client` discovers routers with). `decide(rule, identity, what)` is the whole decision (pure):

    no rule                         → PERMISSION_DENIED (deny by default)
    anonymous, rule open            → allowed
    anonymous, rule not open        → UNAUTHENTICATED
    identity.role ∈ rule.roles      → allowed
    otherwise                       → PERMISSION_DENIED "role R may not call M"

Reflection is admin-only: the protos are public, but nothing but an operator's grpcurl needs it.
`Policy(clients_generate=True)` also lets clients call the worker's generation RPCs and routes directly
(setting `auth_clients_generate`; off by default: a client reaches workers only through a router, which
applies API keys, limits and tenants).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvmesh.core.errors import PermissionDenied, Unauthenticated
from kvmesh.security.identity import CallerRole, Identity

R = CallerRole
ANY_SERVICE = "*"


@dataclass(frozen=True)
class Rule:
    """Who may call one method or route: `roles`, and anonymous callers too when `open`."""

    roles: frozenset[CallerRole]
    open: bool = False

    def describe(self) -> str:
        """The rule as the docs' table cell, e.g. ``router, cache-manager`` or ``anyone``."""
        if self.open and self.roles == frozenset(CallerRole):
            return "anyone"
        names = ", ".join(r.value for r in CallerRole if r in self.roles)
        return f"anyone ({names} by role)" if self.open else names


def _only(*roles: CallerRole) -> Rule:
    return Rule(frozenset(roles))


def _open(*roles: CallerRole) -> Rule:
    return Rule(frozenset(roles or tuple(CallerRole)), open=True)


_CM = "/kvmesh.v1.CacheManagerService/"
_FO = "/kvmesh.v1.FailoverService/"
_KS = "/kvmesh.v1.KvSyncService/"
_PL = "/kvmesh.v1.PlannerService/"
_RT = "/kvmesh.v1.RouterService/"
_RA = "/kvmesh.v1.RouterAdminService/"
_WK = "/kvmesh.v1.WorkerService/"
_ADMIN = _only(R.ADMIN)
_KV_READERS = _only(R.ROUTER, R.CACHE_MANAGER)  # cached token ids are other tenants' prompts
_DATA_PLANE = _only(R.WORKER, R.PEER_ZONE)

GRPC_RULES: Mapping[str, Rule] = {
    # cache-manager
    _CM + "PublishKvEvents": _only(R.WORKER),
    _CM + "FindMatches": _KV_READERS,
    _CM + "WatchIndex": _KV_READERS,
    _CM + "WarmPrefixes": _ADMIN,
    _CM + "SetWarmingPolicy": _ADMIN,
    _CM + "Checkpoint": _ADMIN,
    _CM + "Restore": _ADMIN,
    # the settings-agreement check of the router and of another zone's cache-manager following this index
    _CM + "GetStats": _only(R.ROUTER, R.CACHE_MANAGER, R.ADMIN),
    _CM + "ReportRoutedPrefixes": _only(R.ROUTER),  # what routers routed from their replicas: statistics
    _CM + "ReplicatePrefixes": _only(R.CACHE_MANAGER),  # another zone's cache-manager replicating into this one
    # failover
    _FO + "WatchEndpoints": _open(),  # discovery of routers by kvmesh.client; routers follow it
    _FO + "Register": _only(R.ROUTER, R.ADMIN),
    _FO + "Deregister": _only(R.ROUTER, R.ADMIN),
    _FO + "SetTrafficWeights": _ADMIN,
    _FO + "GetTrafficWeights": _only(R.ADMIN, R.ROUTER),
    _FO + "RollbackTrafficWeights": _ADMIN,
    _FO + "GetZoneHealth": _only(R.ADMIN, R.ROUTER, R.FAILOVER),
    _FO + "StartRollout": _ADMIN,
    _FO + "GetRollout": _ADMIN,
    # kv-sync (a worker's CPU tier, served to its peers)
    _KS + "Describe": _DATA_PLANE,
    # and the cache-manager: it leases a replicated prefix next to its source for the other zone's worker
    _KS + "AcquireLease": _only(R.WORKER, R.CACHE_MANAGER, R.PEER_ZONE),
    _KS + "ReadBlocks": _DATA_PLANE,
    _KS + "WriteBlocks": _DATA_PLANE,
    # router: the client API (API keys checked by the router), and its admin service
    _RT + "Generate": _open(R.CLIENT, R.ADMIN),
    _RA + "Rebalance": _ADMIN,
    _RA + "ListWorkers": _only(R.ADMIN, R.PLANNER),  # the planner's load history and scale-in drains
    _RA + "DrainWorker": _only(R.ADMIN, R.PLANNER),
    _RA + "GetGuardrails": _ADMIN,
    _RA + "ReloadGuardrails": _ADMIN,
    # planner: its forecasts and decisions, for operators
    _PL + "GetPlan": _ADMIN,
    # worker
    # the cache-manager's prefix warming generates; the failover service's canary probes a rollout's versions
    _WK + "Generate": _only(R.ROUTER, R.CACHE_MANAGER, R.FAILOVER),
    _WK + "GenerateStream": _only(R.ROUTER),
    _WK + "Abort": _only(R.ROUTER),
    _WK + "StreamLoad": _only(R.ROUTER, R.FAILOVER),  # the canary reads live error rate and latency
    _WK + "StreamKvEvents": _KV_READERS,
    _WK + "GetInfo": _only(R.ROUTER, R.CACHE_MANAGER, R.ADMIN, R.FAILOVER),
    # grpc's own services
    "/grpc.health.v1.Health/Check": _open(),
    "/grpc.health.v1.Health/Watch": _open(),
    "/grpc.health.v1.Health/List": _open(),
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo": _ADMIN,
}

_CLIENT_GENERATION = frozenset({_WK + "Generate", _WK + "GenerateStream", _WK + "Abort"})

_ROUTER_CLIENT_API = _open(R.CLIENT, R.ADMIN)
_WORKER_HTTP = _only(R.ROUTER)
_WORKER_PROBES = ("/health", "/model_info", "/server_info", "/get_model_info", "/get_server_info")

HTTP_RULES: Mapping[tuple[str, str, str], Rule] = {
    (ANY_SERVICE, "GET", "/metrics"): _open(),
    (ANY_SERVICE, "GET", "/healthz"): _open(),
    ("router", "GET", "/v1/models"): _ROUTER_CLIENT_API,
    ("router", "POST", "/v1/completions"): _ROUTER_CLIENT_API,
    ("router", "POST", "/v1/chat/completions"): _ROUTER_CLIENT_API,
    ("router", "POST", "/tokenize"): _ROUTER_CLIENT_API,  # vLLM's extras, with the router's tokenizer
    ("router", "POST", "/detokenize"): _ROUTER_CLIENT_API,
    ("router", "GET", "/version"): _ROUTER_CLIENT_API,
    # vLLM's probe paths, answered as vLLM does: a load balancer or orchestrator probing has no credential
    ("router", "GET", "/health"): _open(),
    ("router", "GET", "/ping"): _open(),
    ("router", "POST", "/ping"): _open(),
    ("router", "POST", "/admin/rebalance"): _ADMIN,
    ("router", "GET", "/admin/workers"): _ADMIN,
    ("router", "POST", "/admin/drain"): _ADMIN,
    ("worker", "GET", "/v1/models"): _only(R.ROUTER, R.ADMIN),
    ("worker", "POST", "/v1/completions"): _WORKER_HTTP,
    ("worker", "POST", "/v1/chat/completions"): _WORKER_HTTP,
    **{("worker", "GET", p): _only(R.ROUTER, R.ADMIN) for p in _WORKER_PROBES},
}

_CLIENT_HTTP = frozenset({("worker", "POST", "/v1/completions"), ("worker", "POST", "/v1/chat/completions")})


@dataclass(frozen=True)
class Policy:
    """The table as one server applies it; `clients_generate`: clients may generate on workers directly."""

    clients_generate: bool = False

    def grpc_rule(self, full_method: str) -> Rule | None:
        rule = GRPC_RULES.get(full_method)
        if rule is not None and self.clients_generate and full_method in _CLIENT_GENERATION:
            return Rule(rule.roles | {R.CLIENT}, rule.open)
        return rule

    def http_rule(self, service: str, method: str, path: str) -> Rule | None:
        """The rule of `method path` on `service` (HEAD as GET: aiohttp serves it with the GET handler)."""
        method = "GET" if method == "HEAD" else method
        rule = HTTP_RULES.get((service, method, path)) or HTTP_RULES.get((ANY_SERVICE, method, path))
        if rule is not None and self.clients_generate and (service, method, path) in _CLIENT_HTTP:
            return Rule(rule.roles | {R.CLIENT}, rule.open)
        return rule


def decide(rule: Rule | None, identity: Identity | None, what: str) -> None:
    """Raises PermissionDenied / Unauthenticated unless `identity` may call `what` (see the module docstring)."""
    if rule is None:
        raise PermissionDenied(f"{what} is in no row of the authorisation table: denied to everyone")
    if identity is None:
        if rule.open:
            return
        raise Unauthenticated(
            f"{what} needs an identity (a kvmesh client certificate or a bearer token) of role {rule.describe()}"
        )
    if identity.role not in rule.roles:
        raise PermissionDenied(f"role {identity.role.value} may not call {what} (allowed: {rule.describe()})")


def markdown() -> str:
    """The table as docs/security.md shows it: one row per gRPC method and per HTTP route, one column per
    role (✓ allowed), and whether anonymous callers are admitted (scripts/gen_security_table.py)."""
    roles = list(CallerRole)
    head = "| {} | " + " | ".join(r.value for r in roles) + " | anonymous |"
    rule_line = "|---|" + "---|" * (len(roles) + 1)

    def row(name: str, rule: Rule) -> str:
        cells = ["✓" if r in rule.roles else "" for r in roles]
        return f"| `{name}` | " + " | ".join(cells) + f" | {'✓' if rule.open else ''} |"

    out = [head.format("gRPC method"), rule_line]
    out += [row(m, r) for m, r in GRPC_RULES.items()]
    out += ["", head.format("HTTP route (service)"), rule_line]
    out += [row(f"{m} {p} ({svc})", r) for (svc, m, p), r in HTTP_RULES.items()]
    return "\n".join(out) + "\n"
