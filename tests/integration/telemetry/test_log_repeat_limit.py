"""Repeated identical log records are rate-limited in a real service process and counted in its /metrics."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import grpc
import pytest

from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import router_pb2, router_pb2_grpc

pytestmark = pytest.mark.integration

LIMIT = 5
SENT = 20


def test_identical_bad_requests_log_at_most_k_lines_and_count_the_rest(
    services: Callable[..., ServiceProcess],
) -> None:
    # a window longer than the test: the drops are not summarised (nor let through again) meanwhile
    env = {"KVMESH_LOG_REPEAT_LIMIT": str(LIMIT), "KVMESH_LOG_REPEAT_WINDOW_S": "600"}
    router = services("router", env=env)
    with grpc.insecure_channel(router.address) as channel:
        admin = router_pb2_grpc.RouterAdminServiceStub(channel)
        for _ in range(SENT):
            with pytest.raises(grpc.RpcError) as err:
                admin.Rebalance(router_pb2.RebalanceRequest(prefill_weight=-1, decode_weight=1), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # each call's record is logged (or dropped and counted) before its status is sent: no race with the scrape
    body = urllib.request.urlopen(f"http://127.0.0.1:{router.http_port}/metrics", timeout=5).read().decode()
    lines = [ln for ln in router.log().splitlines() if "Rebalance -> INVALID_ARGUMENT" in ln]
    assert len(lines) == LIMIT, "\n".join(lines)
    sample = 'kvmesh_log_records_suppressed_total{level="INFO",logger="kvmesh.rpc.interceptors"}'
    assert f"{sample} {float(SENT - LIMIT)}" in body, [ln for ln in body.splitlines() if "suppressed" in ln]
