"""The router follows the failover service's endpoint sets: real failover, cache-manager, sim-worker and router
processes on 127.0.0.1, over the static registry (a YAML file the failover service re-reads on change).

A worker the registry marks critical leaves the router's rotation within one health interval (observed through
`RouterAdminService.ListWorkers`, polled against a deadline) and gets no request; marked passing again it
comes back and serves. A worker of another zone is not taken while the router's own zone has workers.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc
import pytest

from kvmesh.discovery.model import Health, Role
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.poll import wait_until
from tests.support.procs import start_together
from tests.support.registry import inst, register

pytestmark = pytest.mark.integration
BS = 32
HEALTH_INTERVAL_S = 1.0  # the failover service's --health-interval-s (and the registry checks' default interval)
PASSING = common_pb2.HEALTH_STATE_PASSING


def passing(admin: router_pb2_grpc.RouterAdminServiceStub) -> dict[str, str]:
    """{address: worker id} of the workers the router has in rotation."""
    out = admin.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5)
    return {w.endpoint.address: w.endpoint.id for w in out.workers if w.endpoint.health == PASSING}


def generate(address: str, n: int) -> set[str]:
    """Sends `n` short requests; returns the worker ids that served them."""
    got = set()
    with grpc.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        for k in range(n):
            req = router_pb2.RouterServiceGenerateRequest(
                token_ids=common_pb2.TokenIds(ids=[(7 * k + i) % 1000 + 3 for i in range(3 * BS)]),
                sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
            )
            msgs = list(stub.Generate(req, timeout=20))
            assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            got.add(msgs[-1].worker_id)
    return got


def test_router_follows_endpoint_sets_critical_worker_leaves_and_returns(
    services: Callable[..., ServiceProcess], tmp_path: Path
) -> None:
    reg = tmp_path / "registry.yaml"
    cm = services("cache-manager", "--block-size", str(BS))
    sim = ("--engine", "sim", "--sim-speed", "0", "--block-size", str(BS), "--cache-manager", cm.address)
    w0, w1 = start_together(*[partial(services, "worker", *sim)] * 2)
    # zone b's worker is never reachable: a router of zone a must not take it while zone a has workers
    register(
        reg,
        inst("a-cm", Role.CACHE_MANAGER, cm.address),
        inst("a-w0", Role.WORKER, w0.address),
        inst("a-w1", Role.WORKER, w1.address),
        inst("b-w0", Role.WORKER, "127.0.0.1:9", zone="b"),
    )
    fo = services(
        "failover",
        "--registry-file",
        str(reg),
        "--zones",
        "a,b",
        "--zone",
        "a",
        "--lkg-file",
        str(tmp_path / "lkg.json"),
        "--health-interval-s",
        str(HEALTH_INTERVAL_S),
        "--min-dwell-s",
        "0",
        "--up-hold-s",
        "0",
        "--ramp-s",
        "0",
    )
    router = services("router", "--failover", fo.address, "--zone", "a", "--block-size", str(BS))

    with grpc.insecure_channel(router.address) as ch:
        admin = router_pb2_grpc.RouterAdminServiceStub(ch)
        wait_until(lambda: set(passing(admin)) == {w0.address, w1.address}, 15.0)
        all_workers = admin.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers
        assert "127.0.0.1:9" not in {w.endpoint.address for w in all_workers}
        ids = passing(admin)
        assert generate(router.address, 8) <= set(ids.values())

        register(reg, inst("a-w1", Role.WORKER, w1.address, health=Health.CRITICAL))
        took = wait_until(lambda: w1.address not in passing(admin), 10.0)
        assert took <= HEALTH_INTERVAL_S, f"critical worker left rotation after {took:.2f}s"
        assert generate(router.address, 8) == {ids[w0.address]}

        register(reg, inst("a-w1", Role.WORKER, w1.address))
        wait_until(lambda: w1.address in passing(admin), 10.0)
        admin.DrainWorker(router_pb2.DrainWorkerRequest(worker_id=ids[w0.address], drain=True), timeout=5)
        assert generate(router.address, 3) == {ids[w1.address]}
