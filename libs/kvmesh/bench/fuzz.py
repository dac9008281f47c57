"""``python -m kvmesh.bench fuzz --cases N [--services router,worker,cache-manager,failover]``: fuzzes running
services (the security review) and prints one JSON line
``{"services": {NAME: {"cases", "crashes", "internal", "http_5xx", "healthy_after"}}}``.

Starts a real suite on loopback (cache-manager, a sim worker pushing to it, a router over both, a failover
service on a static registry), then, per service, `N` cases drawn by hypothesis (`kvmesh.fuzzing`): calls of
every RPC of every gRPC service the process serves (listed by its server reflection; the worker's
KvSyncService too, at the address its GetInfo gives), with request messages valid, with unknown fields, wrong
wire types, truncated, with bad UTF-8 or random bytes, sent as raw bytes over a generic channel of the
method's streaming kind (a request stream sends 1-4 messages; a response stream is read for at most
`MAX_RESPONSES` messages within `STREAM_TIMEOUT_S`, then cancelled); and HTTP requests to every route of the
service (`ROUTES`), near paths, wrong methods, odd bodies and headers, raw bytes on the port.

Per service: `crashes` is 1 when the process died or stopped answering gRPC health during its run (the run
ends there); `internal` counts calls answered INTERNAL or UNKNOWN; `http_5xx` answers with a status >= 500;
`healthy_after`: once every service was fuzzed, the process is alive, gRPC health says SERVING and
`GET /healthz` answers 200. Each finding (method, case kind, status, the first bytes of the request) is
printed to stderr as a JSON line.

`--auth` runs the suite least-privilege, as `kvmesh up` does: every service enforces the authorisation table
(kvmesh.security.authz) with role tokens provisioned for the run, and each call or request the fuzzer sends
carries the token of a role the table lets call that method or route (the most privileged such role:
admin, then the services'), so the cases reach the handlers behind the gate, with the identities the
services see in production. `--token-file F` (lines `SERVICE TOKEN`, `*` for every service) instead sends
one `authorization: Bearer TOKEN` with every call and request that does not draw its own Authorization
header.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import math
import socket
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import HypothesisWarning

from kvmesh.fuzzing.http import HttpCase, HttpRoute, http_cases
from kvmesh.fuzzing.proto import GrpcCase, RpcMethod, grpc_cases, methods_of
from kvmesh.security.authz import Policy, Rule
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.security.tokens import accepted_file, provision, read_own_token
from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import cache_manager_pb2, failover_pb2, kvsync_pb2, router_pb2, worker_pb2, worker_pb2_grpc

NAMES = ("router", "worker", "cache-manager", "failover")
R = CallerRole
# the roles the fuzzer acts as under --auth, most privileged first (`Target.token_for`)
ACTING_ROLES = (R.ADMIN, R.ROUTER, R.CACHE_MANAGER, R.WORKER, R.FAILOVER, R.PEER_ZONE, R.PLANNER, R.CLIENT)
SUITE_IDENTITIES = {
    "cache-manager": Identity(R.CACHE_MANAGER, "cache-manager-fuzz"),
    "worker": Identity(R.WORKER, "worker-fuzz-0"),
    "router": Identity(R.ROUTER, "router-fuzz"),
    "failover": Identity(R.FAILOVER, "failover-fuzz"),
    **{f"fuzzer-{r.value}": Identity(r, f"fuzzer-{r.value}") for r in ACTING_ROLES},
}
POLICY = Policy()
ROUTER_KEY = "sk-kvmesh-fuzz"  # the client API key of the suite's router (a loopback-only test suite)
MAX_RESPONSES = 3
UNARY_TIMEOUT_S = 5.0
STREAM_TIMEOUT_S = 0.5
HTTP_TIMEOUT_S = 15.0
MAX_HTTP_READ = 8 << 20
# cases per hypothesis run: its state (example tree, mutation corpus) grows with a run and slows every draw
CHUNK = 500
HEALTH_EVERY = 100  # cases between health checks during a run
MAX_FINDINGS_LOGGED = 20
BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
OPTS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
_PROTOS = (cache_manager_pb2, failover_pb2, kvsync_pb2, router_pb2, worker_pb2)  # their services in the pool

_BASE = [HttpRoute("GET", "/metrics"), HttpRoute("GET", "/healthz")]
_OPENAI = [
    HttpRoute("GET", "/v1/models"),
    HttpRoute("POST", "/v1/completions", "completion"),
    HttpRoute("POST", "/v1/chat/completions", "chat"),
]
_WORKER_PROBES = ("/health", "/model_info", "/server_info", "/get_model_info", "/get_server_info")  # vLLM's, SGLang's
ROUTES: dict[str, list[HttpRoute]] = {
    "router": [
        *_BASE,
        *_OPENAI,
        HttpRoute("POST", "/admin/rebalance", "rebalance"),
        HttpRoute("GET", "/admin/workers"),
        HttpRoute("POST", "/admin/drain", "drain"),
    ],
    "worker": [*_BASE, *_OPENAI, *(HttpRoute("GET", p) for p in _WORKER_PROBES)],
    "cache-manager": _BASE,
    "failover": _BASE,
}


@dataclass
class Outcome:
    """What one service's run found (the JSON row, plus the findings for stderr)."""

    cases: int = 0
    crashes: int = 0
    internal: int = 0
    http_5xx: int = 0
    healthy_after: bool = False
    findings: list[dict[str, Any]] = field(default_factory=list)
    answers: Counter[str] = field(default_factory=Counter)  # gRPC code names and HTTP statuses, for the log

    def row(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "crashes": self.crashes,
            "internal": self.internal,
            "http_5xx": self.http_5xx,
            "healthy_after": self.healthy_after,
        }


@dataclass
class Target:
    """A running service to fuzz: its process, gRPC addresses per served service, HTTP port, token."""

    name: str
    proc: ServiceProcess
    addresses: dict[str, str]  # full gRPC service name -> address
    methods: list[RpcMethod]
    token: str = ""
    role_tokens: dict[CallerRole, str] = field(default_factory=dict)  # --auth: a token per acting role

    def token_for(self, rule: Rule | None) -> str:
        """The token to send where `rule` applies: `token`, or with role tokens the most privileged role the
        rule allows (admin for a path the table does not know, which the gate refuses to anyone)."""
        if not self.role_tokens:
            return self.token
        roles = rule.roles if rule is not None else frozenset({R.ADMIN})
        return next((self.role_tokens[r] for r in ACTING_ROLES if r in roles), "")

    def grpc_metadata(self, full_method: str) -> tuple[tuple[str, str], ...]:
        token = self.token_for(POLICY.grpc_rule(full_method))
        return (("authorization", f"Bearer {token}"),) if token else ()

    def http_token(self, method: str, path: str) -> str:
        return self.token_for(POLICY.http_rule(self.name, method, path))


class StopFuzz(Exception):
    """Ends a run early: the time bound passed, or the service crashed."""


def served_services(address: str, metadata: Any = (), timeout: float = 10.0) -> list[str]:
    """The kvmesh gRPC services a server lists through reflection."""
    with grpc.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        for reply in stub.ServerReflectionInfo(iter([request]), timeout=timeout, metadata=metadata):
            names = [s.name for s in reply.list_services_response.service]
            return sorted(n for n in names if n.startswith("kvmesh."))
    return []


def target_of(
    name: str, sp: ServiceProcess, token: str = "", role_tokens: dict[CallerRole, str] | None = None
) -> Target:
    """Every RPC `sp` serves (and, for a worker, its KvSyncService's)."""
    pool = descriptor_pool.Default()
    target = Target(name, sp, {}, [], token, dict(role_tokens or {}))
    reflection = "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"
    addresses = {s: sp.address for s in served_services(sp.address, target.grpc_metadata(reflection))}
    if name == "worker":
        with grpc.insecure_channel(sp.address) as ch:
            md = target.grpc_metadata(f"/{worker_pb2.DESCRIPTOR.services_by_name['WorkerService'].full_name}/GetInfo")
            info = worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10, metadata=md)
        if info.kvsync_address:
            addresses[kvsync_pb2.DESCRIPTOR.services_by_name["KvSyncService"].full_name] = info.kvsync_address
    target.addresses = addresses
    target.methods = [m for s in addresses for m in methods_of(pool.FindServiceByName(s))]
    return target


# ---- gRPC ------------------------------------------------------------------------------------------------
class GrpcSender:
    """Sends a `GrpcCase` as raw bytes (identity serializers) on channels kept open per address."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.channels = {a: grpc.insecure_channel(a, options=OPTS) for a in set(target.addresses.values())}

    def close(self) -> None:
        for ch in self.channels.values():
            ch.close()

    def send(self, case: GrpcCase) -> grpc.StatusCode:
        """The call's final status code (CANCELLED when a response stream was cut short by us)."""
        m = case.method
        ch = self.channels[self.target.addresses[m.service]]
        md = self.target.grpc_metadata(m.path)
        try:
            if m.server_streaming:
                return self._read_stream(ch, m, case.messages, md)
            if m.client_streaming:
                ch.stream_unary(m.path)(iter(case.messages), timeout=UNARY_TIMEOUT_S, metadata=md)
            else:
                ch.unary_unary(m.path)(case.messages[0], timeout=UNARY_TIMEOUT_S, metadata=md)
        except grpc.RpcError as e:
            return e.code()  # type: ignore[attr-defined,no-any-return]
        return grpc.StatusCode.OK

    @staticmethod
    def _read_stream(ch: grpc.Channel, m: RpcMethod, messages: tuple[bytes, ...], md: Any) -> grpc.StatusCode:
        if m.client_streaming:
            call = ch.stream_stream(m.path)(iter(messages), timeout=STREAM_TIMEOUT_S, metadata=md)
        else:
            call = ch.unary_stream(m.path)(messages[0], timeout=STREAM_TIMEOUT_S, metadata=md)
        try:
            for i, _ in enumerate(call):
                if i + 1 >= MAX_RESPONSES:
                    call.cancel()
                    return grpc.StatusCode.CANCELLED
        except grpc.RpcError as e:
            return e.code()  # type: ignore[attr-defined,no-any-return]
        return grpc.StatusCode.OK


# ---- HTTP ------------------------------------------------------------------------------------------------
class HttpSender:
    """Sends an `HttpCase` on one kept-alive connection (reopened after any error); returns the status, or 0
    when no HTTP answer came (the server closed the connection, e.g. on a malformed request)."""

    def __init__(self, port: int, token_for: Callable[[str, str], str] = lambda _m, _p: "") -> None:
        self.port = port
        self.token_for = token_for  # (method, path) -> the bearer token to send, "" for none
        self.conn: http.client.HTTPConnection | None = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def send(self, case: HttpCase) -> int:
        if case.raw:
            return self._raw(case.raw)
        if self.conn is None:
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=HTTP_TIMEOUT_S)
        try:
            return self._request(self.conn, case)
        except (OSError, http.client.HTTPException, ValueError):
            self.close()
            return 0

    def _request(self, conn: http.client.HTTPConnection, case: HttpCase) -> int:
        conn.putrequest(case.method, case.path, skip_accept_encoding=True)
        names = {k.lower() for k, _ in case.headers}
        for k, v in case.headers:
            conn.putheader(k, v.encode("latin-1"))
        token = self.token_for(case.method, case.path.split("?", 1)[0])
        if token and "authorization" not in names:
            conn.putheader("Authorization", f"Bearer {token}")
        if case.body or case.method in ("POST", "PUT", "PATCH"):
            conn.putheader("Content-Length", str(len(case.body)))
        conn.endheaders(case.body or None)
        resp = conn.getresponse()
        got = 0
        while got <= MAX_HTTP_READ:
            chunk = resp.read(1 << 16)
            if not chunk:
                break
            got += len(chunk)
        if got > MAX_HTTP_READ or resp.will_close:
            self.close()
        return resp.status

    def _raw(self, data: bytes) -> int:
        """Writes `data`, half-closes, reads the answer's status line (if any)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=3.0) as s:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                head = s.recv(64)
        except OSError:
            return 0
        parts = head.split(b" ", 2)
        return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else 0


# ---- health ----------------------------------------------------------------------------------------------
def grpc_serving(address: str, timeout: float = 5.0) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def healthz_ok(port: int, timeout: float = 5.0) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def healthy(sp: ServiceProcess) -> bool:
    """Alive, gRPC health SERVING and /healthz 200."""
    return sp.proc.poll() is None and grpc_serving(sp.address) and healthz_ok(sp.http_port)


# ---- one run ---------------------------------------------------------------------------------------------
def _finding(case: GrpcCase | HttpCase, answer: str) -> dict[str, Any]:
    if isinstance(case, GrpcCase):
        return {
            "rpc": case.method.path,
            "kinds": list(case.kinds),
            "answer": answer,
            "request_hex": case.messages[0][:96].hex(),
            "request_bytes": [len(b) for b in case.messages],
        }
    first = case.raw or case.body
    return {
        "http": f"{case.method} {case.path[:120]}",
        "kind": case.kind,
        "answer": answer,
        "headers": [list(h) for h in case.headers][:8],
        "body_head": first[:200].decode("utf-8", "replace"),
        "body_bytes": len(first),
    }


def _drive(strategy: st.SearchStrategy[Any], n: int, rng_seed: int, body: Callable[[Any], None]) -> None:
    """One hypothesis run of `n` examples of `strategy` through `body` (generation only: no shrinking, no
    database); hypothesis' own reports go to stderr, never to the JSON line on stdout."""

    @seed(rng_seed)
    @settings(
        max_examples=n,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
    )
    @given(strategy)
    def run(case: Any) -> None:
        body(case)

    with contextlib.redirect_stdout(sys.stderr), warnings.catch_warnings():
        warnings.simplefilter("ignore", HypothesisWarning)  # the repr of a huge last case
        run()


def fuzz_service(target: Target, cases: int, time_limit_s: float | None = None, rng_seed: int = 0) -> Outcome:
    """Sends up to `cases` hypothesis-drawn cases to `target` (fewer if the time bound passes or the service
    crashes); healthy_after is left for the caller (the suite is checked once every service ran)."""
    out = Outcome()
    grpc_send, http_send = GrpcSender(target), HttpSender(target.proc.http_port, target.http_token)
    deadline = None if time_limit_s is None else time.monotonic() + time_limit_s
    strategy: st.SearchStrategy[Any] = st.one_of(grpc_cases(target.methods), http_cases(ROUTES[target.name]))

    def record(case: GrpcCase | HttpCase, answer: str) -> None:
        out.findings.append(_finding(case, answer))

    stop: list[str] = []  # why the run ended early: raised again on hypothesis' replay of the last case

    def run_one(case: GrpcCase | HttpCase) -> None:
        if deadline is not None and time.monotonic() > deadline:
            stop.append("time bound")
            raise StopFuzz(stop[0])
        if isinstance(case, GrpcCase):
            code = grpc_send.send(case)
            out.answers[code.name] += 1
            if code in BAD_CODES:
                out.internal += 1
                record(case, code.name)
        else:
            status = http_send.send(case)
            out.answers[f"HTTP {status}"] += 1
            if status >= 500:
                out.http_5xx += 1
                record(case, str(status))
        out.cases += 1
        alive = target.proc.proc.poll() is None
        if not alive or (out.cases % HEALTH_EVERY == 0 and not grpc_serving(target.proc.address)):
            out.crashes = 1
            record(case, "process died" if not alive else "health not SERVING")
            stop.append("crashed")
            raise StopFuzz(stop[0])

    def body(case: GrpcCase | HttpCase) -> None:
        if stop:
            raise StopFuzz(stop[0])
        if out.cases < cases:
            run_one(case)

    try:
        for chunk in range(math.ceil(cases / CHUNK)):
            before = out.cases
            _drive(strategy, min(CHUNK, cases - out.cases), rng_seed * 1_000_003 + chunk, body)
            if out.cases == before or out.cases >= cases:
                break
    except StopFuzz:
        pass
    finally:
        grpc_send.close()
        http_send.close()
    return out


# ---- the suite -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def suite(tmp: Path, auth: bool = False) -> Iterator[dict[str, ServiceProcess]]:
    """cache-manager, a sim worker pushing to it, a router over both (client API keys on: `ROUTER_KEY`), a
    failover service; all stopped after. `auth`: every service enforces the table with tokens provisioned in
    ``tmp/auth`` (`role_tokens` reads the fuzzer's)."""
    started: list[ServiceProcess] = []
    own = provision(tmp / "auth", list(SUITE_IDENTITIES.values())) if auth else {}

    def start(name: str, *args: str) -> ServiceProcess:
        flags = list(args)
        if auth:
            flags += ["--auth-mode", "enforce", "--auth-tokens-file", str(accepted_file(tmp / "auth"))]
            flags += ["--auth-token-file", str(own[SUITE_IDENTITIES[name]])]
        sp = start_service(name, tmp / "svc", *flags, timeout=90)
        started.append(sp)
        return sp

    try:
        cm = start(
            "cache-manager", "--block-size", "16", "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-interval-s", "0"
        )
        worker = start(
            "worker",
            *("--engine", "sim", "--sim-speed", "0", "--block-size", "16", "--kv-blocks", "2048"),
            *("--max-model-len", "8192", "--cache-manager", cm.address),
            *("--service-id", SUITE_IDENTITIES["worker"].id),
        )
        keys = tmp / "api-keys.yaml"  # role admin: the fuzz reaches the admin handlers, not only the key check
        keys.write_text(f"- {{key: {ROUTER_KEY}, id: fuzz, role: admin}}\n")
        router = start(
            "router",
            *("--workers", worker.address, "--cache-manager", cm.address, "--block-size", "16"),
            *("--api-keys-file", str(keys)),
        )
        failover = start(
            "failover",
            *("--registry-file", str(tmp / "registry.yaml"), "--lkg-file", str(tmp / "lkg.json")),
            *("--zones", "local", "--static-probe-interval-s", "0"),
        )
        yield {"router": router, "worker": worker, "cache-manager": cm, "failover": failover}
    finally:
        for sp in reversed(started):
            try:
                sp.terminate(timeout=20)
            except Exception:
                sp.kill()


def role_tokens(tmp: Path) -> dict[CallerRole, str]:
    """The fuzzer's token per acting role, from the files `suite(tmp, auth=True)` provisioned."""
    ids = [SUITE_IDENTITIES[f"fuzzer-{r.value}"] for r in ACTING_ROLES]
    return {i.role: read_own_token(str(tmp / "auth" / f"{i.role.value}-{i.id}.token")) for i in ids}


def read_tokens(path: str) -> dict[str, str]:
    """`SERVICE TOKEN` lines (`*`: every service; `#` comments)."""
    tokens: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        parts = line.split()
        if parts and not parts[0].startswith("#") and len(parts) == 2:
            tokens[parts[0]] = parts[1]
    return tokens


def fuzz_suite(
    procs: dict[str, ServiceProcess],
    names: Sequence[str],
    cases: int,
    time_limit_s: float | None = None,
    tokens: dict[str, str] | None = None,
    log: Callable[[str], None] = lambda _s: None,
    by_role: dict[CallerRole, str] | None = None,
) -> dict[str, Outcome]:
    """Fuzzes each of `names` in turn (`time_limit_s` per service), then checks every one is healthy. The
    router's calls carry `ROUTER_KEY` unless `tokens` name another; with `by_role` (an --auth suite's
    `role_tokens`) each call carries the token of a role the table allows for it instead."""
    tokens = {"router": ROUTER_KEY, **(tokens or {})}
    outcomes: dict[str, Outcome] = {}
    for i, name in enumerate(names):
        token = tokens.get(name, tokens.get("*", ""))
        t0 = time.monotonic()
        target = target_of(name, procs[name], token, by_role)
        outcomes[name] = fuzz_service(target, cases, time_limit_s, rng_seed=i)
        took = time.monotonic() - t0
        o = outcomes[name]
        progress = {"service": name, "cases": o.cases, "seconds": round(took, 1), "answers": dict(o.answers)}
        log(json.dumps(progress))
        for f in outcomes[name].findings[:MAX_FINDINGS_LOGGED]:
            log(json.dumps({"service": name, "finding": f}))
    for name in names:
        outcomes[name].healthy_after = healthy(procs[name])
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmesh.bench fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=1000, help="cases per service")
    ap.add_argument("--services", default=",".join(NAMES), help="comma list of " + ", ".join(NAMES))
    ap.add_argument("--time-limit-s", type=float, default=None, help="bound per service (default: none)")
    ap.add_argument("--token-file", default="", help="lines 'SERVICE TOKEN' ('*' = all): bearer token per service")
    ap.add_argument("--auth", action="store_true", help="services enforce the table; calls carry allowed roles' tokens")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.services.split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        ap.error(f"unknown services {unknown}; known: {', '.join(NAMES)}")
    tokens = read_tokens(args.token_file) if args.token_file else {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-fuzz-") as tmp, suite(Path(tmp), args.auth) as procs:
        by_role = role_tokens(Path(tmp)) if args.auth else None
        outcomes = fuzz_suite(procs, names, args.cases, args.time_limit_s, tokens, _stderr, by_role)
    print(json.dumps({"services": {n: o.row() for n, o in outcomes.items()}, "auth": args.auth}), flush=True)
    return 0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
