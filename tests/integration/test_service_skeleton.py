"""The service skeleton with real processes: TLS on the endpoint watch, and settings that must agree."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from kvmesh.client.watch import EndpointWatcher
from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.certs import make_pki
from tests.support.procs import ServiceProcess

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
