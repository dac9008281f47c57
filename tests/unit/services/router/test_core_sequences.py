"""`RouterCore` with `n > 1` and log-probabilities, against scripted worker calls: the sequences of one attempt
stream with their indexes, each finish ends its own sequence, usage counts every sequence, log-probabilities
reach the chunks as domain types, and a mid-stream failure resumes each unfinished sequence on its own."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.core.generation import PositionLogprobs, SamplingParams, TokenLogprob
from kvmesh.services.router.request import RouterRequest
from kvmesh.services.router.stream_requests import rpc_error
from kvmesh.v1 import common_pb2, worker_pb2
from tests.unit.services.router.test_core_driver import LIMITS, PROMPT, FakePool, ScriptedCall, core_for

pytestmark = pytest.mark.unit

STOP = common_pb2.FINISH_REASON_STOP


def seq_step(index: int, ids: list[int], finish: int = 0, logprob: float | None = None) -> worker_pb2.GenerateResponse:
    msg = worker_pb2.GenerateResponse(token_ids=ids, text="t" * len(ids), finish_reason=finish, index=index)
    if logprob is not None:
        for t in ids:
            top = [common_pb2.TokenLogprob(token_id=t + 1, logprob=logprob - 1, rank=2)]
            msg.logprobs.add(token=common_pb2.TokenLogprob(token_id=t, logprob=logprob, rank=1), top=top)
    return msg


def request_n(n: int, **kw: object) -> RouterRequest:
    sampling = SamplingParams(max_tokens=10, n=n, seed=3, **kw)  # type: ignore[arg-type]
    return RouterRequest.checked(LIMITS, "r1", PROMPT, sampling)


async def test_n_sequences_stream_with_their_indexes_on_one_worker_and_usage_counts_all() -> None:
    call = ScriptedCall(
        [
            seq_step(0, [7]),
            seq_step(1, [8]),
            seq_step(0, [9], finish=STOP),  # sequence 0 ends, the request goes on
            seq_step(1, [10, 11], finish=STOP),
        ],
        None,
    )
    pool = FakePool([call])
    chunks = [c async for c in core_for(pool).generate(request_n(2))]
    assert [(c.index, c.token_ids, c.finish_reason) for c in chunks] == [
        (0, [7], 0),
        (1, [8], 0),
        (0, [9], STOP),
        (1, [10, 11], STOP),
    ]
    assert [c.usage is not None for c in chunks] == [False, False, False, True]
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT), 5)
    (sent,) = pool.sent  # one attempt: the sequences share the prompt's KV on one worker
    assert sent.sampling.n == 2 and sent.sampling.seed == 3


async def test_logprobs_pass_through_as_domain_types_and_the_sampling_reaches_the_worker() -> None:
    prompt_lp = worker_pb2.GenerateResponse()
    prompt_lp.prompt_logprobs.add()  # the prompt's first token has none
    prompt_lp.prompt_logprobs.add(token=common_pb2.TokenLogprob(token_id=2, logprob=-0.5, rank=3))
    call = ScriptedCall([prompt_lp, seq_step(0, [7, 8], logprob=-0.25), seq_step(0, [], finish=STOP)], None)
    pool = FakePool([call])
    chunks = [c async for c in core_for(pool).generate(request_n(1, logprobs=1, prompt_logprobs=0))]
    assert chunks[0].prompt_logprobs == (None, PositionLogprobs(TokenLogprob(2, -0.5, 3)))
    assert chunks[1].logprobs == tuple(
        PositionLogprobs(TokenLogprob(t, -0.25, 1), (TokenLogprob(t + 1, -1.25, 2),)) for t in (7, 8)
    )
    (sent,) = pool.sent
    assert (sent.sampling.logprobs, sent.sampling.prompt_logprobs) == (1, 0)


async def test_a_mid_stream_failure_resumes_each_unfinished_sequence_on_its_own() -> None:
    broken = ScriptedCall(
        [seq_step(0, [7]), seq_step(1, [8]), seq_step(2, [9], finish=STOP)],
        rpc_error(grpc.StatusCode.UNAVAILABLE, "died"),
    )
    resumed = [ScriptedCall([seq_step(0, [20 + i], finish=STOP)], None) for i in range(2)]
    pool = FakePool([broken, *resumed])
    chunks = [c async for c in core_for(pool).generate(request_n(3, prompt_logprobs=1))]
    tokens: dict[int, list[int]] = {}
    for c in chunks:
        tokens.setdefault(c.index, []).extend(c.token_ids)
    assert sorted(tokens[0] + tokens[1]) == [7, 8, 20, 21] and tokens[2] == [9]
    assert {c.index for c in chunks if c.finish_reason} == {0, 1, 2}
    assert [c.usage is not None for c in chunks].count(True) == 1 and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].migrations == 1
    first, *again = pool.sent
    assert first.sampling.n == 3
    # each resumed from prompt + its own tokens, n = 1, without asking for the prompt's log-probabilities again
    assert sorted(list(r.token_ids.ids)[len(PROMPT) :] for r in again) == [[7], [8]]
    assert all(r.sampling.n == 1 and not r.sampling.HasField("prompt_logprobs") for r in again)
    assert sorted(r.sampling.max_tokens for r in again) == [9, 9]
    assert sorted(r.request_id for r in again) == ["r1-0", "r1-1"]


async def test_a_failure_before_any_token_retries_the_whole_request() -> None:
    failed = ScriptedCall([], rpc_error(grpc.StatusCode.UNAVAILABLE, "down"))
    ok = ScriptedCall([seq_step(0, [7], finish=STOP), seq_step(1, [8], finish=STOP)], None)
    pool = FakePool([failed, ok])
    chunks = [c async for c in core_for(pool).generate(request_n(2))]
    assert [c.index for c in chunks] == [0, 1] and [r.sampling.n for r in pool.sent] == [2, 2]


def test_resumed_tokens_resume_one_sequence_only() -> None:
    sampling = dataclasses.replace(SamplingParams(max_tokens=10), n=2)
    with pytest.raises(InvalidArgument, match="resume_token_ids"):
        RouterRequest.checked(LIMITS, "r1", PROMPT, sampling, resume_ids=[5])
