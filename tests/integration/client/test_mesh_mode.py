"""Service-mesh mode of kvmesh.client: a plain gRPC channel over several router addresses (as a DNS name would
resolve), balanced round-robin with grpc.health.v1 health checking, keeps serving when one router dies; its
calls carry the bearer token of its `ChannelSecurity` (a router API key here)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc
import httpx
import pytest

from kvmesh.client.mesh import mesh_aio_channel, mesh_channel
from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support.procs import ServiceProcess, start_together

pytestmark = pytest.mark.integration


def _request(i: int) -> router_pb2.RouterServiceGenerateRequest:
    return router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[3 + (i + k) % 900 for k in range(40)]),
        sampling=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True),
    )


def test_mesh_channel_balances_and_survives_a_dead_router(services: Callable[..., ServiceProcess]) -> None:
    worker = services("worker", "--engine", "sim", "--sim-speed", "0")
    routers = start_together(
        *(partial(services, "router", "--workers", worker.address, "--service-id", f"router-{i}") for i in range(2))
    )
    target = "ipv4:" + ",".join(r.address for r in routers)  # what a DNS name with two A records resolves to
    with mesh_channel(target) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        for i in range(20):
            final = list(stub.Generate(_request(i), timeout=30))[-1]
            assert final.usage.completion_tokens == 3
        served = [_router_requests(r) for r in routers]
        assert all(n > 0 for n in served), f"round_robin should use both routers: {served}"

        routers[0].kill()  # kill -9: the channel's health check and retry policy move every call to router-1
        before = _router_requests(routers[1])
        for i in range(20):
            final = list(stub.Generate(_request(100 + i), timeout=30))[-1]
            assert final.usage.completion_tokens == 3
        assert _router_requests(routers[1]) - before == 20


def test_mesh_channel_sends_its_key(services: Callable[..., ServiceProcess], tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("- {key: sk-mesh, id: mesh, tenants: [mesh]}\n")
    worker = services("worker", "--engine", "sim", "--sim-speed", "0")
    router = services("router", "--workers", worker.address, "--api-keys-file", str(keys))
    target = f"ipv4:{router.address}"
    with mesh_channel(target) as channel, pytest.raises(grpc.RpcError) as err:
        list(router_pb2_grpc.RouterServiceStub(channel).Generate(_request(0), timeout=30))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with mesh_channel(target, security=ChannelSecurity(token="sk-mesh")) as channel:
        final = list(router_pb2_grpc.RouterServiceStub(channel).Generate(_request(1), timeout=30))[-1]
    assert final.usage.completion_tokens == 3

    async def aio() -> int:
        async with mesh_aio_channel(target, security=ChannelSecurity(token="sk-mesh")) as channel:
            stream = router_pb2_grpc.RouterServiceStub(channel).Generate(_request(2), timeout=30)
            return [m async for m in stream][-1].usage.completion_tokens

    assert asyncio.run(aio()) == 3


def _router_requests(router: ServiceProcess) -> int:
    text = httpx.get(f"http://127.0.0.1:{router.http_port}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith('kvmesh_rpc_requests_total{code="OK",method="Generate"'):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)
