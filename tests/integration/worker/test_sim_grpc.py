"""A real worker process (simulated engine) over gRPC on 127.0.0.1: streaming, prefix hits, KV event
stream with dump / replay, load reports, cancel -> abort, INVALID_ARGUMENT and RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from kvmesh.index.hashing import compute_block_hashes
from kvmesh.rpc.errors import bad_request_fields, retry_after_s
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support.sim_worker import BS, gen_req, start_sim_worker

pytestmark = pytest.mark.integration


@pytest_asyncio.fixture
async def stub(sim_worker: ServiceProcess) -> AsyncIterator[worker_pb2_grpc.WorkerServiceStub]:
    async with grpc.aio.insecure_channel(sim_worker.address) as ch:
        yield worker_pb2_grpc.WorkerServiceStub(ch)


async def test_stream_prefix_hit_and_kv_events(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    assert info.engine == "sim" and info.block_size == BS and info.kv_blocks_total == 2048
    events = stub.StreamKvEvents(worker_pb2.StreamKvEventsRequest(), timeout=30)
    first = await events.read()  # a fresh subscriber gets a dump first
    assert first.kind == common_pb2.KV_STREAM_KIND_DUMP_BEGIN and first.batch.instance_id == info.instance_id
    while first.kind != common_pb2.KV_STREAM_KIND_DUMP_END:
        first = await events.read()
    base_seq = first.batch.sequence

    prompt = list(range(100, 100 + 6 * BS + 3))
    msgs = [m async for m in stub.Generate(gen_req("g1", prompt, max_tokens=5, detokenize=True), timeout=30)]
    assert sum(len(m.token_ids) for m in msgs) == 5 and msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert msgs[-1].usage.prompt_tokens == len(prompt) and msgs[-1].usage.cached_tokens == 0
    assert all(m.text for m in msgs) and msgs[-1].worker_id == info.worker_id

    stored: list[int] = []
    tokens: list[int] = []
    async with asyncio.timeout(10):
        while len(stored) < 6:
            msg = await events.read()
            assert msg.kind == common_pb2.KV_STREAM_KIND_LIVE and msg.batch.sequence > base_seq
            for e in msg.batch.events:
                stored += list(e.block_stored.block_hashes)
                tokens += list(e.block_stored.token_ids)
    assert tokens[: 6 * BS] == prompt[: 6 * BS]
    assert stored[:6] == [int(h) for h in compute_block_hashes(prompt, BS, 0)]
    events.cancel()

    shared = [*prompt[: 4 * BS], 7, 7, 7]
    msgs2 = [m async for m in stub.Generate(gen_req("g2", shared, max_tokens=2), timeout=30)]
    assert msgs2[-1].usage.cached_tokens == 4 * BS

    # replay from the first live sequence of this instance: no dump, the same batches again
    start = worker_pb2.StreamKvEventsRequest(start_sequence=base_seq + 1, instance_id=info.instance_id)
    replay = stub.StreamKvEvents(start, timeout=30)
    again = await replay.read()
    assert again.kind == common_pb2.KV_STREAM_KIND_LIVE and again.batch.sequence == base_seq + 1
    replay.cancel()


async def test_load_reports_and_cancel_aborts(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    call = stub.Generate(gen_req("long", list(range(1, 200)), max_tokens=7000), timeout=60)
    await call.read()
    loads = stub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=20), timeout=30)
    rep = (await loads.read()).report
    assert rep.running == 1 and rep.kv_blocks_used > 0
    call.cancel()
    async with asyncio.timeout(10):
        while rep.running != 0:  # the worker notices the cancel and aborts the engine request
            rep = (await loads.read()).report
    assert rep.kv_blocks_used == 0
    loads.cancel()
    abort = await stub.Abort(worker_pb2.AbortRequest(request_id="long"), timeout=5)
    assert not abort.aborted


async def test_invalid_arguments(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    cases = [
        (gen_req("t", [1, 2, 3], max_tokens=9000), "max_tokens"),
        (gen_req("p", list(range(1, 8101)), max_tokens=100), "max_tokens"),
        (gen_req("q", list(range(1, 8200)), max_tokens=0), "prompt"),
    ]
    bad_t = gen_req("neg", [1, 2, 3])
    bad_t.sampling.temperature = -1.0
    cases.append((bad_t, "sampling.temperature"))
    for req, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            [m async for m in stub.Generate(req, timeout=10)]
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in bad_request_fields(ei.value)
    ok = [m async for m in stub.Generate(gen_req("ok", [1, 2, 3], max_tokens=1), timeout=10)]
    assert ok[-1].usage.completion_tokens == 1


async def test_queue_full_is_resource_exhausted_with_retry_info(tmp_path: Path) -> None:
    sp = start_sim_worker(tmp_path, "--sim-speed", "1", "--max-queue", "1", "--max-num-seqs", "1")
    try:
        async with grpc.aio.insecure_channel(sp.address) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            running = stub.Generate(gen_req("a", list(range(1, 50)), max_tokens=8000), timeout=60)
            await running.read()
            waiting = stub.Generate(gen_req("b", [1, 2, 3]), timeout=60)
            loads = stub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=20), timeout=30)
            async with asyncio.timeout(10):
                while (await loads.read()).report.waiting != 1:
                    pass
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                [m async for m in stub.Generate(gen_req("c", [1, 2, 3]), timeout=10)]
            assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (retry_after_s(ei.value) or 0) > 0
            for c in (running, waiting, loads):
                c.cancel()
    finally:
        assert sp.terminate(timeout=30) == 0


async def test_prefill_only_warms_the_cache(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    prompt = list(range(5000, 5000 + 3 * BS + 1))
    warm = [m async for m in stub.Generate(gen_req("warm", prompt, prefill_only=True), timeout=10)]
    assert len(warm) == 1 and not warm[0].token_ids and warm[0].usage.completion_tokens == 0
    hit = [m async for m in stub.Generate(gen_req("use", prompt, max_tokens=1), timeout=10)]
    assert hit[-1].usage.cached_tokens == 3 * BS
