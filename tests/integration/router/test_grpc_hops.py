"""A suite started as `kvmesh up` starts it (`kvmesh.suite.local.start`, the default configuration but for free
ports and no planner) sends its router's requests to the workers over gRPC: after a real request through the
router, the worker that served it has the router's `GenerateStream` open in its per-method gRPC metrics
(`kvmesh.rpc.interceptors`), no Generate call and no generate-frames connection, and no frames listener at
all. A service mesh between them would see, authorise and measure that call. The opt-in fast path
(`router.workerTransport: frames`) still serves, on a frames connection and no gRPC call."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvmesh.suite import config as suite_config
from kvmesh.suite import local
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.scrape import metric

pytestmark = pytest.mark.integration


@contextlib.contextmanager
def _suite(tmp_path: Path, *sets: str) -> Iterator[tuple[local.Suite, ServiceProcess]]:
    settings = suite_config.load(None, ["ports.auto=true", "planner.enabled=false", "worker.replicas=2", *sets])
    suite = local.start(settings, tmp_path / "run")
    try:
        yield suite, next(sp for sp in suite.services if sp.name == "router")
    finally:
        for sp in reversed(suite.services):
            try:
                sp.terminate(timeout=15)
            except Exception:
                sp.kill()


def _generate(suite: local.Suite, router: ServiceProcess) -> str:
    """One request through the router with the suite's client token; the id of the worker that served it."""
    token = Path(suite.auth.state()["tokens"]["client"]).read_text().strip()
    req = router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=list(range(7, 107))),
        sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
    )
    with grpc.insecure_channel(router.address) as ch:
        msgs = list(
            router_pb2_grpc.RouterServiceStub(ch).Generate(req, metadata=(("authorization", f"Bearer {token}"),))
        )
    assert msgs[-1].usage.completion_tokens == 4
    return msgs[-1].worker_id


def _served_by(suite: local.Suite, worker_id: str) -> ServiceProcess:
    return next(sp for sp in suite.services if sp.name == "worker" and sp.info["id"] == worker_id)


def test_a_default_suite_reaches_its_workers_over_grpc(tmp_path: Path) -> None:
    with _suite(tmp_path) as (suite, router):
        worker = _served_by(suite, _generate(suite, router))
        port = worker.http_port
        assert metric(port, "kvmesh_rpc_in_flight", 'method="GenerateStream"') == 1  # the router's stream, open
        assert metric(port, "kvmesh_rpc_requests_total", 'method="Generate"') == 0
        assert metric(port, "kvmesh_worker_generate_frames_connections") == 0
        workers = [sp for sp in suite.services if sp.name == "worker"]
        assert all("generate frames on" not in sp.log() for sp in workers)  # no opaque listener to reach


def test_the_opt_in_frames_fast_path_serves_without_a_grpc_call(tmp_path: Path) -> None:
    with _suite(tmp_path, "router.workerTransport=frames") as (suite, router):
        worker = _served_by(suite, _generate(suite, router))
        port = worker.http_port
        assert metric(port, "kvmesh_worker_generate_frames_connections") == 1
        assert metric(port, "kvmesh_rpc_in_flight", 'method="GenerateStream"') == 0
        assert metric(port, "kvmesh_rpc_requests_total", 'method="Generate"') == 0
