"""Every service process: health, reflection, input validation, deadlines, drain on SIGTERM, TLS/mTLS.

Real processes on 127.0.0.1 with port 0, real gRPC, real signals.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvmesh.rpc.errors import bad_request_fields
from kvmesh.rpc.interceptors import DEADLINE_TRAILER
from kvmesh.v1 import (
    cache_manager_pb2,
    cache_manager_pb2_grpc,
    failover_pb2,
    failover_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.support.certs import make_pki
from tests.support.procs import ServiceProcess, wait_serving

pytestmark = pytest.mark.integration

EXPECTED_SERVICES = {
    "router": {"kvmesh.v1.RouterService", "kvmesh.v1.RouterAdminService"},
    "worker": {"kvmesh.v1.WorkerService"},
    "cache-manager": {"kvmesh.v1.CacheManagerService"},
    "failover": {"kvmesh.v1.FailoverService"},
}
# Flags that let a service start without its peers (the worker needs an engine).
START_FLAGS: dict[str, tuple[str, ...]] = {
    "worker": ("--engine", "sim"),
    "router": (),
    "cache-manager": (),
    "failover": (),
}

Start = Callable[..., ServiceProcess]


@pytest.mark.parametrize("name", sorted(EXPECTED_SERVICES))
def test_health_and_reflection_answer(services: Start, name: str) -> None:
    sp = services(name, *START_FLAGS[name])
    with grpc.insecure_channel(sp.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", *EXPECTED_SERVICES[name]):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(
            stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        )
        listed = {s.name for s in replies[0].list_services_response.service}
        assert EXPECTED_SERVICES[name] <= listed
        assert "grpc.health.v1.Health" in listed


def test_malformed_requests_get_invalid_argument_naming_the_field(services: Start) -> None:
    router = services("router")
    failover = services("failover")
    cache = services("cache-manager")
    cases: list[tuple[str, str, Callable[[grpc.Channel], object]]] = [
        (
            router.address,
            "prefill_weight",
            lambda ch: router_pb2_grpc.RouterAdminServiceStub(ch).Rebalance(
                router_pb2.RebalanceRequest(prefill_weight=-1.0, decode_weight=0.3), timeout=5
            ),
        ),
        (
            router.address,
            "prompt",
            lambda ch: list(
                router_pb2_grpc.RouterServiceStub(ch).Generate(
                    router_pb2.RouterServiceGenerateRequest(request_id="r1"), timeout=5
                )
            ),
        ),
        (
            failover.address,
            "weights.zone_weights[a]",
            lambda ch: failover_pb2_grpc.FailoverServiceStub(ch).SetTrafficWeights(
                failover_pb2.SetTrafficWeightsRequest(
                    weights=failover_pb2.TrafficWeights(zone_weights={"a": -0.5, "b": 1.0})
                ),
                timeout=5,
            ),
        ),
        (
            cache.address,
            "query",
            lambda ch: cache_manager_pb2_grpc.CacheManagerServiceStub(ch).FindMatches(
                cache_manager_pb2.FindMatchesRequest(), timeout=5
            ),
        ),
    ]
    for address, field, call in cases:
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                call(channel)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value)
            assert field in err.value.details()
            assert bad_request_fields(err.value) == [field]
    # The services survived the bad input.
    for sp in (router, failover, cache):
        wait_serving(sp.address, timeout=5)
        assert sp.proc.poll() is None


def test_client_deadline_reaches_the_server(services: Start) -> None:
    router = services("router")
    with grpc.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterAdminServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Rebalance(router_pb2.RebalanceRequest(prefill_weight=-1, decode_weight=1), timeout=3.0)
        trailers = dict(err.value.trailing_metadata() or ())
        seen_ms = int(trailers[DEADLINE_TRAILER])
        # gRPC sends the timeout in a `grpc-timeout` header rounded up to its unit (up to tens of ms), so the
        # server may see a few ms more than the client's 3 s, never a deadline from anywhere else.
        assert 0 < seen_ms <= 3000 + 50
        assert trailers["x-request-id"]
        # Without a deadline the server sees none.
        with pytest.raises(grpc.RpcError) as err2:
            stub.Rebalance(router_pb2.RebalanceRequest(prefill_weight=-1, decode_weight=1))
        assert DEADLINE_TRAILER not in dict(err2.value.trailing_metadata() or ())


def test_request_id_is_taken_from_metadata(services: Start) -> None:
    router = services("router")
    with grpc.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterAdminServiceStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Rebalance(
                router_pb2.RebalanceRequest(prefill_weight=-1, decode_weight=1),
                timeout=5,
                metadata=(("x-request-id", "req-abc-123"),),
            )
        assert dict(err.value.trailing_metadata() or ())["x-request-id"] == "req-abc-123"


def test_sigterm_drains_an_open_stream_and_exits_zero(services: Start) -> None:
    """An open server stream sees the service go NOT_SERVING and end cleanly; the process exits 0."""
    sp = services("cache-manager")
    with grpc.insecure_channel(sp.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        first = next(watch)
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        sp.proc.send_signal(15)
        statuses = []
        try:
            for reply in watch:
                statuses.append(reply.status)
        except grpc.RpcError as err:
            # The stream may be ended by the server's shutdown after the status change was delivered.
            assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), err
        assert health_pb2.HealthCheckResponse.NOT_SERVING in statuses
    assert sp.proc.wait(timeout=30) == 0
    assert "stopped" in sp.log()


def test_tls_and_mtls(services: Start, tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    tls = services("router", "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), wait_healthy=False)
    good = grpc.ssl_channel_credentials(root_certificates=pki.ca.read_bytes())
    wait_serving(tls.address, timeout=30, credentials=good)
    # A client that does not trust the CA is refused.
    bad = grpc.ssl_channel_credentials(root_certificates=pki.other_ca.read_bytes())
    with grpc.secure_channel(tls.address, bad) as channel, pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # A plaintext client is refused too.
    with grpc.insecure_channel(tls.address) as channel, pytest.raises(grpc.RpcError):
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)

    mtls = services(
        "router",
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--tls-client-ca",
        str(pki.ca),
        wait_healthy=False,
    )
    with_cert = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(),
        private_key=pki.client_key.read_bytes(),
        certificate_chain=pki.client_cert.read_bytes(),
    )
    wait_serving(mtls.address, timeout=30, credentials=with_cert)
    with grpc.secure_channel(mtls.address, good) as channel, pytest.raises(grpc.RpcError) as err:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_metrics_endpoint_counts_calls_by_code(services: Start) -> None:
    import urllib.request

    router = services("router")
    with grpc.insecure_channel(router.address) as channel, pytest.raises(grpc.RpcError):
        router_pb2_grpc.RouterAdminServiceStub(channel).Rebalance(
            router_pb2.RebalanceRequest(prefill_weight=-1, decode_weight=1), timeout=5
        )
    body = urllib.request.urlopen(f"http://127.0.0.1:{router.http_port}/metrics", timeout=5).read().decode()
    assert 'kvmesh_rpc_requests_total{code="INVALID_ARGUMENT",method="Rebalance",service="router"} 1.0' in body


def test_worker_rejects_generate_without_prompt(services: Start) -> None:
    worker = services("worker", *START_FLAGS["worker"])
    with grpc.insecure_channel(worker.address) as channel, pytest.raises(grpc.RpcError) as err:
        list(worker_pb2_grpc.WorkerServiceStub(channel).Generate(worker_pb2.GenerateRequest(request_id="x"), timeout=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad_request_fields(err.value) == ["prompt"]


def test_a_service_freezes_its_start_up_heap_unless_told_not_to(services: Start) -> None:
    # the ready file counts what gc.freeze moved out of the collector's full passes: the modules, protobuf
    # descriptors and grpc objects every service builds at start-up are tens of thousands of objects
    frozen = services("worker", *START_FLAGS["worker"]).info
    assert frozen["gc_frozen_objects"] > 20_000, frozen
    assert "gc_frozen_objects" not in services("worker", *START_FLAGS["worker"], "--gc-freeze", "false").info
