"""The service skeleton with real processes: TLS on the endpoint watch, and settings that must agree."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from kvmesh.client.watch import EndpointWatcher
from kvmesh.discovery.model import Role, ServiceInstance
from kvmesh.discovery.static import StaticRegistry
from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.security.certs import make_dev_pki
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.certs import make_pki
from tests.support.procs import ServiceProcess, wait_serving

pytestmark = pytest.mark.integration

Start = Callable[..., ServiceProcess]


async def test_watcher_reaches_a_tls_only_failover_with_tls_settings(services: Start, tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    fo = services("failover", "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key), wait_healthy=False)
    secure = EndpointWatcher([fo.address], security=ChannelSecurity(tls_ca=str(pki.ca)))
    plain = EndpointWatcher([fo.address])
    await secure.start()
    await plain.start()
    try:
        assert await secure.wait_update(0, 20.0) > 0
        assert secure.connected_to == fo.address
        assert plain.updates == 0 and plain.connected_to is None  # plaintext to a TLS-only server gets nothing
    finally:
        await secure.stop()
        await plain.stop()


def test_router_follows_a_mtls_only_failover_over_tls(services: Start, tmp_path: Path) -> None:
    """Every hop mTLS with the table enforced (identities from a `kvmesh certs` CA): the failover service accepts
    only TLS with a client certificate, so a router that learns its worker from it connected over TLS; the
    failover's health probes of the worker and the router's calls to the worker are TLS too."""
    R = CallerRole
    ids = {r: Identity(r, f"{r.value}-1", "local") for r in (R.ROUTER, R.WORKER, R.FAILOVER, R.ADMIN)}
    ids[R.WORKER] = Identity(R.WORKER, "w-tls", "local")
    pki = make_dev_pki(tmp_path / "pki", list(ids.values()))

    def tls(role: CallerRole) -> list[str]:
        pair, ca = pki.pairs[ids[role]], str(pki.ca)
        flags = ["--tls-cert", str(pair.cert), "--tls-key", str(pair.key), "--tls-client-ca", ca, "--tls-ca", ca]
        return [*flags, "--tls-client-cert", str(pair.cert), "--tls-client-key", str(pair.key)]

    def creds(role: CallerRole) -> grpc.ChannelCredentials:
        pair = pki.pairs[ids[role]]
        return grpc.ssl_channel_credentials(pki.ca.read_bytes(), pair.key.read_bytes(), pair.cert.read_bytes())

    admin = creds(R.ADMIN)
    worker = services("worker", "--engine", "sim", "--service-id", "w-tls", *tls(R.WORKER), credentials=admin)
    registry = tmp_path / "registry.yaml"
    host, _, port = worker.address.rpartition(":")
    asyncio.run(
        StaticRegistry(registry).register(ServiceInstance("w-tls", Role.WORKER, "local", "v1", host, int(port)))
    )
    fo = services("failover", "--registry-file", str(registry), *tls(R.FAILOVER), wait_healthy=False)
    wait_serving(fo.address, 30, credentials=admin)
    router = services("router", "--failover", fo.address, *tls(R.ROUTER), wait_healthy=False)
    wait_serving(router.address, 30, credentials=admin)
    deadline = time.monotonic() + 30
    with grpc.secure_channel(router.address, admin) as ch:
        stub = router_pb2_grpc.RouterAdminServiceStub(ch)
        while True:  # bounded: the follower's first endpoint set, then the worker's GetInfo
            listed = stub.ListWorkers(router_pb2.ListWorkersRequest(), timeout=5).workers
            if any(w.endpoint.id == "w-tls" and w.endpoint.health == common_pb2.HEALTH_STATE_PASSING for w in listed):
                break
            assert time.monotonic() < deadline, f"router did not take the worker from the failover: {listed}"
            time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as refused:  # the failover speaks TLS only: plaintext gets no handshake
        wait_serving(fo.address, 2)
    assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_router_refuses_to_start_against_a_cache_manager_with_another_block_size(services: Start) -> None:
    cm = services("cache-manager", "--block-size", "16")
    with pytest.raises(RuntimeError, match="exited with 2") as err:
        services("router", "--cache-manager", cm.address, "--block-size", "32")
    assert "--block-size 16" in str(err.value) and "--block-size 32" in str(err.value)


def test_router_refuses_to_start_against_a_cache_manager_with_another_salt_model(services: Start) -> None:
    cm = services("cache-manager", "--model", "llama")
    with pytest.raises(RuntimeError, match="exited with 2") as err:
        services("router", "--cache-manager", cm.address, "--salt-model", "qwen")
    assert "'llama'" in str(err.value) and "'qwen'" in str(err.value) and "--salt-model" in str(err.value)


def test_router_does_not_route_to_a_worker_with_another_block_size(services: Start) -> None:
    good = services("worker", "--engine", "sim", "--block-size", "32", "--service-id", "w-good")
    bad = services("worker", "--engine", "sim", "--block-size", "16", "--service-id", "w-bad")
    router = services("router", "--workers", f"{good.address},{bad.address}", "--block-size", "32")
    with grpc.insecure_channel(router.address) as ch:
        listed = router_pb2_grpc.RouterAdminServiceStub(ch).ListWorkers(router_pb2.ListWorkersRequest(), timeout=10)
    by_address = {w.endpoint.address: w.endpoint for w in listed.workers}
    assert by_address[good.address].id == "w-good"
    assert by_address[good.address].health == common_pb2.HEALTH_STATE_PASSING
    # the mismatched worker is held but never identified, so never in the routable views
    assert by_address[bad.address].id == "" and by_address[bad.address].health == common_pb2.HEALTH_STATE_CRITICAL
    log = router.log()
    assert "w-bad" in log and "--block-size 16" in log and "--block-size 32" in log
