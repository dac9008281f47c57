"""`kvmesh_router_workers_routable` (the gauge the RouterNoRoutableWorkers alert reads) counts the workers the
routing profile may pick: it follows a drain and a dead worker, and reads 0 only when none is left."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from functools import partial

import grpc
import httpx
import pytest

from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import router_pb2, router_pb2_grpc
from tests.support.procs import start_together

pytestmark = pytest.mark.integration


def routable(router: ServiceProcess) -> float:
    text = httpx.get(f"http://127.0.0.1:{router.http_port}/metrics", timeout=10).text
    m = re.search(r"^kvmesh_router_workers_routable (\S+)$", text, re.M)
    assert m, "the router exports no kvmesh_router_workers_routable"
    return float(m.group(1))


def wait_routable(router: ServiceProcess, want: float, timeout_s: float = 20) -> float:
    deadline = time.monotonic() + timeout_s
    seen = routable(router)
    while seen != want and time.monotonic() < deadline:
        seen = routable(router)
    return seen


def test_routable_gauge_follows_drain_and_loss(services: Callable[..., ServiceProcess]) -> None:
    workers = start_together(
        *[partial(services, "worker", "--engine", "sim", "--sim-speed", "0", "--block-size", "32")] * 2
    )
    router = services("router", "--workers", ",".join(w.address for w in workers), "--block-size", "32")
    assert wait_routable(router, 2) == 2
    with grpc.insecure_channel(router.address) as ch:
        admin = router_pb2_grpc.RouterAdminServiceStub(ch)
        ids = [w.endpoint.id for w in admin.ListWorkers(router_pb2.ListWorkersRequest(), timeout=10).workers]
        admin.DrainWorker(router_pb2.DrainWorkerRequest(worker_id=ids[0], drain=True), timeout=10)
        assert wait_routable(router, 1) == 1
        admin.DrainWorker(router_pb2.DrainWorkerRequest(worker_id=ids[0], drain=False), timeout=10)
        assert wait_routable(router, 2) == 2
    workers[1].kill()
    assert wait_routable(router, 1) == 1
