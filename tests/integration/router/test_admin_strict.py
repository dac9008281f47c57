"""The router's admin routes take only typed JSON (the security review: "/admin/drain accepts text/plain, so a web
page can send it (CSRF), and the string "false" drains"), and every admin action is an audit line. A real router process
with two sim workers on loopback; the drained state is read back through RouterAdminService/ListWorkers.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import grpc
import httpx
import pytest

from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import router_pb2, router_pb2_grpc
from tests.support.procs import start_together

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    d: Path = tmp_path_factory.mktemp("admin")
    workers = start_together(*[partial(start_service, "worker", d, "--engine", "sim", "--sim-speed", "0")] * 2)
    r = start_service("router", d, "--workers", ",".join(w.address for w in workers))
    yield r
    for sp in (r, *workers):
        assert sp.terminate(timeout=30) == 0


def draining(router: ServiceProcess) -> dict[str, bool]:
    with grpc.insecure_channel(router.address) as ch:
        ws = router_pb2_grpc.RouterAdminServiceStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
    return {w.endpoint.id: w.draining for w in ws.workers}


def post(router: ServiceProcess, path: str, body: bytes, content_type: str | None) -> httpx.Response:
    headers = {"Content-Type": content_type} if content_type is not None else {}
    return httpx.post(f"http://127.0.0.1:{router.http_port}{path}", content=body, headers=headers, timeout=10)


def audit(router: ServiceProcess, action: str) -> list[dict[str, object]]:
    """The router's audit lines of `action` so far (its log is written before each response is sent)."""
    out = []
    for line in router.log().splitlines():
        _, sep, msg = line.partition("kvmesh.audit: ")
        if sep and json.loads(msg)["action"] == action:
            out.append(json.loads(msg))
    return out


def test_drain_takes_only_typed_json_and_each_attempt_is_audited(router: ServiceProcess) -> None:
    wid = sorted(draining(router))[0]
    body = json.dumps({"worker_id": wid, "drain": True}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        r = post(router, "/admin/drain", body, ctype)
        assert r.status_code == 415, (ctype, r.text)
        assert r.json()["error"]["param"] == "Content-Type"
    for bad, field in (
        ({"worker_id": wid, "drain": "false"}, "drain"),  # the string "false" is not a boolean
        ({"worker_id": wid, "drain": 1}, "drain"),
        ({"worker_id": 7}, "worker_id"),
        ({"worker_id": wid, "drian": False}, "drian"),  # a typo is refused, not ignored (the default drains)
    ):
        r = post(router, "/admin/drain", json.dumps(bad).encode(), "application/json")
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == field
    assert not any(draining(router).values()), "a refused request drained a worker"

    r = post(router, "/admin/drain", body, "application/json; charset=utf-8")
    assert r.status_code == 200 and draining(router)[wid]
    r = post(router, "/admin/drain", json.dumps({"worker_id": wid, "drain": False}).encode(), "application/json")
    assert r.status_code == 200 and not draining(router)[wid]

    lines = audit(router, "POST /admin/drain")
    assert [a["result"] for a in lines] == ["UNSUPPORTED_MEDIA_TYPE"] * 4 + ["INVALID_ARGUMENT"] * 4 + ["ok"] * 2
    assert all(a["who"] == "anonymous" and a["service"] == "router" for a in lines)
    assert [a["args"] for a in lines[-2:]] == [{"worker_id": wid, "drain": True}, {"worker_id": wid, "drain": False}]


def test_rebalance_typed_and_grpc_admin_refuses_unknown_fields(router: ServiceProcess) -> None:
    r = post(router, "/admin/rebalance", b'{"prefill_weight": "0.9", "decode_weight": 0.1}', "application/json")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prefill_weight"
    r = post(router, "/admin/rebalance", b'{"prefill_weight": 0.9, "decode_weight": 0.1}', "text/plain")
    assert r.status_code == 415
    r = post(router, "/admin/rebalance", b'{"prefill_weight": 0.25, "decode_weight": 0.75}', "application/json")
    assert r.status_code == 200 and r.json()["prefill_weight"] == pytest.approx(0.25)

    wid = sorted(draining(router))[1]
    with grpc.insecure_channel(router.address) as ch:
        raw = ch.unary_unary(
            "/kvmesh.v1.RouterAdminService/DrainWorker",
            request_serializer=lambda b: b,
            response_deserializer=router_pb2.DrainWorkerResponse.FromString,
        )
        req = router_pb2.DrainWorkerRequest(worker_id=wid, drain=True).SerializeToString()
        with pytest.raises(grpc.RpcError) as ei:
            raw(req + b"\xa0\x06\x01", timeout=10)  # + unknown field 100
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not draining(router)[wid]
    rebalances = audit(router, "POST /admin/rebalance")
    assert [a["result"] for a in rebalances] == ["INVALID_ARGUMENT", "UNSUPPORTED_MEDIA_TYPE", "ok"]
    drains = audit(router, "RouterAdminService/DrainWorker")
    args = {"worker_id": wid, "drain": True, "force": False}
    assert drains[-1]["result"] == "INVALID_ARGUMENT" and drains[-1]["args"] == args
