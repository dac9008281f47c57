"""Input hardening, quiet logs: what a client can repeat for free (disconnecting from an SSE stream, sending garbage
to the HTTP port) is logged at INFO without a traceback (it was ERROR with one), and a disconnected stream
is cancelled on the worker with its admission slot freed. Real processes: a slow sim worker, a router."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc
import httpx
import pytest

from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import router_pb2, router_pb2_grpc
from tests.support.poll import wait_until
from tests.support.sim_worker import BS, start_sim_worker

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def slow_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """Real-time sim speed: a 4000-token stream lasts far longer than the test."""
    sp = start_sim_worker(tmp_path_factory.mktemp("w"), "--sim-speed", "1")
    yield sp
    assert sp.terminate(timeout=30) == 0


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory, slow_worker: ServiceProcess) -> Iterator[ServiceProcess]:
    flags = ("--workers", slow_worker.address, "--block-size", str(BS))
    sp = start_service("router", tmp_path_factory.mktemp("r"), *flags, timeout=60)
    yield sp
    assert sp.terminate(timeout=30) == 0


def in_flight(router: ServiceProcess) -> int:
    with grpc.insecure_channel(router.address) as ch:
        out = router_pb2_grpc.RouterAdminServiceStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
    return sum(w.in_flight for w in out.workers)


def assert_quiet(log: str) -> None:
    assert "Traceback" not in log, log
    assert not [line for line in log.splitlines() if "ERROR" in line], log


def test_sse_client_disconnect_is_info_and_frees_the_request(router: ServiceProcess) -> None:
    url = f"http://127.0.0.1:{router.http_port}/v1/completions"
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
        assert in_flight(router) == 1
    # the connection is closed mid-stream: the router notices at its next write
    wait_until(lambda: "client disconnected mid-stream" in router.log())
    wait_until(lambda: in_flight(router) == 0)
    metrics = httpx.get(f"http://127.0.0.1:{router.http_port}/metrics", timeout=10).text
    assert 'kvmesh_router_requests_total{api="completions",outcome="cancelled"} 1.0' in metrics
    assert_quiet(router.log())


def test_malformed_http_is_info_without_traceback(router: ServiceProcess) -> None:
    for garbage in (b"GARBAGE\x00\xff\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: x\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", router.http_port), timeout=20) as s:
            s.sendall(garbage)
            assert s.recv(65536).startswith(b"HTTP/1.0 400"), garbage
    wait_until(lambda: "BadHttpMessage" in router.log())  # the bad Content-Length (a bad method logs at DEBUG)
    assert_quiet(router.log())
