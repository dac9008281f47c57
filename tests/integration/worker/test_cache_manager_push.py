"""A simulated worker pushes its KV events to a real cache-manager (PublishKvEvents with hello, dump and
sequence numbers); the cache-manager's index then finds the worker's prefix. A restarted cache-manager
gets a full dump and matches again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import cache_manager_pb2 as cm
from kvmesh.v1 import cache_manager_pb2_grpc as cm_grpc
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.integration
BS = 16
MODEL = "sim-test-model"


async def matched(cm_addr: str, worker_id: str, ids: list[int], want: int, timeout: float = 15) -> int:
    """Blocks the cache-manager matches for `worker_id`, polled (bounded) until it reaches `want`."""
    got = 0
    async with grpc.aio.insecure_channel(cm_addr) as ch:
        stub = cm_grpc.CacheManagerServiceStub(ch)
        async with asyncio.timeout(timeout):
            while got < want:
                r = await stub.FindMatches(
                    cm.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=ids), model=MODEL), timeout=5
                )
                got = {m.worker_id: m.matched_blocks for m in r.matches}.get(worker_id, 0)
                if got < want:
                    await asyncio.sleep(0.05)  # bounded poll of another process's eventual state
    return got


def start_cm(tmp: Path, port: int = 0) -> ServiceProcess:
    return start_service(
        "cache-manager",
        tmp,
        "--block-size",
        str(BS),
        "--model",
        MODEL,
        "--checkpoint-interval-s",
        "0",
        "--warm-interval-s",
        "0",
        port=port,
    )


async def test_worker_events_reach_the_index_and_survive_a_cache_manager_restart(tmp_path: Path) -> None:
    cmp = start_cm(tmp_path / "cm")
    cm_port = int(cmp.address.rsplit(":", 1)[1])
    w = start_service(
        "worker",
        tmp_path / "w",
        "--engine",
        "sim",
        "--model",
        MODEL,
        "--block-size",
        str(BS),
        "--kv-blocks",
        "512",
        "--sim-speed",
        "0",
        "--cache-manager",
        cmp.address,
    )
    try:
        async with grpc.aio.insecure_channel(w.address) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
            prompt = list(range(10, 10 + 5 * BS + 2))
            req = worker_pb2.GenerateRequest(
                request_id="a",
                token_ids=common_pb2.TokenIds(ids=prompt),
                sampling=common_pb2.SamplingParams(max_tokens=1),
            )
            [m async for m in stub.Generate(req, timeout=10)]
        assert await matched(cmp.address, info.worker_id, prompt, 5) == 5
        assert cmp.terminate(timeout=30) == 0
        cmp = start_cm(tmp_path / "cm2", port=cm_port)  # same address: the worker reconnects and dumps
        assert await matched(cmp.address, info.worker_id, prompt, 5, timeout=30) == 5
    finally:
        w.terminate(timeout=30)
        cmp.terminate(timeout=30)
