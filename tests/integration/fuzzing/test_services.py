"""A bounded fuzzing run (`kvmesh.bench.fuzz`) against real router, worker, cache-manager and failover
processes: hypothesis-drawn protobuf messages on every RPC and HTTP requests on every route, then each
service must have answered every case without INTERNAL / UNKNOWN or a 5xx, and still be healthy."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from kvmesh.bench.fuzz import NAMES, fuzz_service, fuzz_suite, healthy, role_tokens, suite, target_of
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import cache_manager_pb2, cache_manager_pb2_grpc
from tests.support.sim_worker import start_sim_worker

pytestmark = pytest.mark.integration
CASES = 250
TIME_LIMIT_S = 60.0  # per service; at ~25-65 cases/s on 2 shared cores a run takes 4-10 s


@pytest.mark.parametrize("auth", [False, True], ids=["open", "least-privilege"])
def test_every_service_survives_a_bounded_fuzz_run(tmp_path: Path, auth: bool) -> None:
    """Open services, and services enforcing the table whose every case carries an allowed role's token (so
    the cases get past the gate: the same OK / INVALID_ARGUMENT mix as open services show)."""
    with suite(tmp_path, auth) as procs:
        by_role = role_tokens(tmp_path) if auth else None
        outcomes = fuzz_suite(procs, NAMES, CASES, TIME_LIMIT_S, by_role=by_role)
        with grpc.insecure_channel(procs["cache-manager"].address) as ch:  # the gate is on: anonymous is refused
            find = cache_manager_pb2_grpc.CacheManagerServiceStub(ch).FindMatches
            anonymous = _code(lambda: find(cache_manager_pb2.FindMatchesRequest(), timeout=10))
        assert anonymous == (grpc.StatusCode.UNAUTHENTICATED if auth else grpc.StatusCode.INVALID_ARGUMENT)
    for name in NAMES:
        o = outcomes[name]
        assert o.crashes == 0, (name, o.findings[:3])
        assert o.internal == 0, (name, o.findings[:3])
        assert o.http_5xx == 0, (name, o.findings[:3])
        assert o.healthy_after, name
        assert o.cases >= CASES // 2, (name, o.cases)
        # the cases got past decoding and routing: some calls served, some refused on their content
        assert o.answers["OK"] > 0 and o.answers["INVALID_ARGUMENT"] > 0, (name, dict(o.answers))
        assert o.answers["HTTP 200"] > 0 and o.answers["HTTP 400"] + o.answers["HTTP 405"] > 0, (name, o.answers)


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return,attr-defined]
    return grpc.StatusCode.OK


def test_a_dead_service_is_a_crash_and_not_healthy(tmp_path: Path) -> None:
    worker = start_sim_worker(tmp_path)
    target = target_of("worker", worker)
    worker.kill()
    o = fuzz_service(target, 50)
    assert (o.crashes, o.cases) == (1, 1)
    assert o.findings[-1]["answer"] == "process died"
    assert not healthy(worker)


@pytest.mark.parametrize("header", ["X-Session-Id", "Authorization", "X-Api-Key"])
def test_router_refuses_a_header_that_is_not_utf8_naming_it(
    services: Callable[..., ServiceProcess], tmp_path: Path, header: str
) -> None:
    """Found by the fuzzer: a Latin-1 byte in X-Session-Id (hashed for affinity) or in the API key (compared
    as UTF-8) reached the router as a lone surrogate and was answered 500."""
    keys = tmp_path / "keys"
    keys.write_text("sk-k\n")
    worker = services("worker", "--engine", "sim", "--sim-speed", "0", "--block-size", "16")
    router = services("router", "--workers", worker.address, "--block-size", "16", "--api-keys-file", str(keys))
    value = b"Bearer \xe9" if header == "Authorization" else b"\xe9\x8a"
    hdrs = {"Authorization": b"Bearer sk-k", header: value} if header == "X-Session-Id" else {header: value}
    conn = http.client.HTTPConnection("127.0.0.1", router.http_port, timeout=30)
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    conn.putrequest("POST", "/v1/completions")
    for k, v in hdrs.items():
        conn.putheader(k, v)
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    resp = conn.getresponse()
    err = json.loads(resp.read())["error"]
    assert (resp.status, err["param"]) == (400, header), err
    assert "UTF-8" in err["message"]
    conn.close()
