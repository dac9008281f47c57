"""kvmesh.client against real routers + sim workers, discovered through the failover service and the
Consul STAND-IN: weighted pick, retry before the first token, resume of a stream broken by SIGKILL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc.aio
import pytest

from kvmesh.client import AsyncClient, Client
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, failover_pb2, failover_pb2_grpc, router_pb2
from tests.consul_standin.launch import StandinProcess, start_standin

pytestmark = pytest.mark.integration
BS = 32


@pytest.fixture
def standin() -> Iterator[StandinProcess]:
    sp = start_standin()
    yield sp
    sp.stop()


def gen(n_prompt: int, max_tokens: int) -> router_pb2.RouterServiceGenerateRequest:
    return router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=list(range(7, 7 + n_prompt))),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0),
    )


async def register(
    fo: ServiceProcess, iid: str, role: common_pb2.ServiceRole.ValueType, sp: ServiceProcess, zone: str
) -> None:
    async with grpc.aio.insecure_channel(fo.address) as ch:
        await failover_pb2_grpc.FailoverServiceStub(ch).Register(
            failover_pb2.RegisterRequest(
                endpoint=common_pb2.Endpoint(id=iid, role=role, address=sp.address, zone=zone, version="v1"),
                check_interval_s=0.3,
            ),
            timeout=5,
        )


async def wait_routers(client: AsyncClient, ids: set[str], timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    seen = client.watcher.updates
    while set(client.watcher.current.router_weights) != ids:
        left = deadline - time.monotonic()
        assert left > 0, f"routers {ids} not published; have {client.watcher.current.router_weights}"
        seen = await client.watcher.wait_update(seen, left)


async def test_client_weighted_pick_retry_and_resume(
    services: Callable[..., ServiceProcess], standin: StandinProcess, tmp_path: Path
) -> None:
    workers = {
        z: services("worker", "--engine", "sim", "--block-size", str(BS), "--kv-blocks", "4096", "--zone", z)
        for z in ("a", "b")
    }
    routers = {
        z: services("router", "--workers", workers[z].address, "--block-size", str(BS), "--zone", z) for z in ("a", "b")
    }
    fo = services(
        "failover",
        "--consul-url",
        f"http://127.0.0.1:{standin.port}",
        "--zones",
        "a,b",
        "--require-cache-manager",
        "false",
        "--health-interval-s",
        "0.2",
        "--watch-wait-s",
        "2",
        "--lkg-file",
        str(tmp_path / "lkg.json"),
    )
    for z in ("a", "b"):
        await register(fo, f"router-{z}", common_pb2.SERVICE_ROLE_ROUTER, routers[z], z)
        await register(fo, f"worker-{z}", common_pb2.SERVICE_ROLE_WORKER, workers[z], z)
    zone_of_worker = {workers[z].info["id"]: z for z in ("a", "b")}

    async with AsyncClient([fo.address], timeout_s=60) as client:
        await wait_routers(client, {"router-a", "router-b"})
        # weighted pick: both zones carry traffic at 50/50
        served = {"a": 0, "b": 0}
        for _ in range(30):
            msgs = [m async for m in client.generate(gen(40, 2))]
            assert sum(len(m.token_ids) for m in msgs) == 2
            served[zone_of_worker[msgs[0].worker_id]] += 1
        assert served["a"] >= 5 and served["b"] >= 5, served

        # a stream broken mid-way by SIGKILL of its router resumes on the other one, without duplicates
        max_tokens = 120
        agen = client.generate(gen(64, max_tokens))
        first = await asyncio.wait_for(agen.__anext__(), 30)
        victim = zone_of_worker[first.worker_id]
        routers[victim].kill()
        rest = [m async for m in agen]
        msgs = [first, *rest]
        tokens = [t for m in msgs for t in m.token_ids]
        assert len(tokens) == max_tokens, f"got {len(tokens)} tokens"
        assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert client.resumes_total >= 1
        assert {zone_of_worker[m.worker_id] for m in rest[-1:]} == {"a", "b"} - {victim}

        # requests sent right after the kill never fail: retried before their first token
        for _ in range(10):
            msgs = [m async for m in client.generate(gen(40, 2))]
            assert sum(len(m.token_ids) for m in msgs) == 2
        await wait_routers(client, {f"router-{z}" for z in ("a", "b") if z != victim})

    # the synchronous facade over the same machinery
    with Client([fo.address], timeout_s=30) as sync_client:
        msgs = list(sync_client.generate(gen(40, 3)))
        assert sum(len(m.token_ids) for m in msgs) == 3
