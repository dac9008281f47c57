"""A real worker process (simulated engine) and the sampling fields beyond OpenAI's basics: `n` sequences and
log-probabilities reach the wire on both Generate and GenerateStream; refusals name their field."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from kvmesh.rpc.errors import bad_request_fields
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support.sim_worker import BS, gen_req

pytestmark = pytest.mark.integration
PROMPT = list(range(300, 300 + 2 * BS + 5))


@pytest_asyncio.fixture
async def stub(sim_worker: ServiceProcess) -> AsyncIterator[worker_pb2_grpc.WorkerServiceStub]:
    async with grpc.aio.insecure_channel(sim_worker.address) as ch:
        yield worker_pb2_grpc.WorkerServiceStub(ch)


def check_sequences(msgs: list[worker_pb2.GenerateResponse]) -> None:
    finished = sorted(m.index for m in msgs if m.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED)
    assert finished == [0, 1]
    for m in msgs:
        assert [p.token.token_id for p in m.logprobs] == list(m.token_ids) and all(len(p.top) == 2 for p in m.logprobs)
    assert msgs[-1].usage.completion_tokens == 6 and msgs[-1].usage.prompt_tokens == len(PROMPT)
    assert len(msgs[0].prompt_logprobs) == len(PROMPT) and not msgs[0].prompt_logprobs[0].HasField("token")


def sampled(rid: str) -> worker_pb2.GenerateRequest:
    req = gen_req(rid, PROMPT, max_tokens=3)
    req.sampling.n, req.sampling.temperature, req.sampling.logprobs, req.sampling.prompt_logprobs = 2, 1.0, 2, 0
    return req


async def test_sequences_and_logprobs_on_both_streams(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    check_sequences([m async for m in stub.Generate(sampled("n-gen"), timeout=30)])

    async def starts() -> AsyncIterator[worker_pb2.GenerateStreamRequest]:
        yield worker_pb2.GenerateStreamRequest(start=sampled("n-stream"))

    got = [m async for m in stub.GenerateStream(starts(), timeout=30)]
    assert all(m.request_id == "n-stream" and not m.error_code for m in got)
    check_sequences([m.response for m in got])


async def test_refusals_name_the_field(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    schema = gen_req("so", PROMPT)
    schema.sampling.structured_output.json_object = True
    many = gen_req("lp", PROMPT)
    many.sampling.logprobs = 21
    for req, field in [(schema, "structured_outputs"), (many, "logprobs")]:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            [m async for m in stub.Generate(req, timeout=30)]
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in bad_request_fields(ei.value)
