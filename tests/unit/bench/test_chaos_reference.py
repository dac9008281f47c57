"""The reference run's near ties: where a real engine's greedy pick could go either way."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any
from unittest.mock import patch

from kvmesh.bench.chaos_check import TIE_NATS, RequestRecord, verdict
from kvmesh.bench.chaos_reference import confirm_flips, fill_references, near_ties
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc


def step(*top: tuple[int, float], pick: int = 0) -> common_pb2.PositionLogprobs:
    return common_pb2.PositionLogprobs(
        token=common_pb2.TokenLogprob(token_id=top[pick][0], logprob=top[pick][1], rank=pick + 1),
        top=[common_pb2.TokenLogprob(token_id=t, logprob=lp, rank=i + 1) for i, (t, lp) in enumerate(top)],
    )


def test_near_ties_are_the_positions_whose_two_best_are_within_the_bound_counted_from_the_offset() -> None:
    steps = [
        step((5, -0.50), (6, -0.50 - TIE_NATS / 2)),  # a near tie: 6 could have won
        step((7, -0.10), (8, -3.00)),  # a clear choice
        step((9, -1.00), (4, -1.00 - TIE_NATS)),  # exactly at the bound: still a tie
        step((3, -1.00), (2, -1.00 - 2 * TIE_NATS)),
        step((1, -0.2)),  # one alternative only: nothing to flip to
    ]
    assert near_ties(steps) == {0: [5, 6], 2: [9, 4]}
    assert near_ties(steps, offset=10) == {10: [5, 6], 12: [9, 4]}


def test_a_tie_is_every_token_within_the_bound_of_the_best_whatever_the_engine_ranks_first() -> None:
    """vLLM ranks a sampled token by how many are at least as likely: of two equal ones the greedy pick can be
    listed second. The tie is the set, so the pick is in it wherever it is listed."""
    equal = step((571, -1.0), (837, -1.0), (4, -1.0 - TIE_NATS / 2), (9, -2.0), pick=1)
    listed_below = step((3, -0.7), (8, -0.7 - TIE_NATS / 2), (5, -0.9))
    assert near_ties([equal, listed_below]) == {0: [571, 837, 4], 1: [3, 8]}
    assert 837 in near_ties([equal])[0] and 9 not in near_ties([equal])[0]


def best(context: Sequence[int]) -> list[int]:
    """A toy greedy model: the most likely next tokens after `context`, two of them (a near tie) after a
    multiple of 5."""
    t = (context[-1] * 7 + 3) % 50 + 10
    return [t, t + 1] if context[-1] % 5 == 0 else [t]


def greedy(context: Sequence[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(best([*context, *out])[0])
    return out


class ToyWorker:
    """A worker stub whose Generate answers `best`'s greedy tokens with their top log-probabilities."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def Generate(self, req: worker_pb2.GenerateRequest, timeout: float) -> AsyncIterator[worker_pb2.GenerateResponse]:
        context = list(req.token_ids.ids)
        self.calls.append(context)

        async def answer() -> AsyncIterator[worker_pb2.GenerateResponse]:
            out: list[int] = []
            for _ in range(req.sampling.max_tokens):
                top = best([*context, *out])
                out.append(top[0])
                yield worker_pb2.GenerateResponse(token_ids=[top[0]], text=letters([top[0]]), logprobs=[
                    step(*[(t, -1.0) for t in top], (999, -5.0))
                ])  # fmt: skip

        return answer()


def letters(tokens: Sequence[int]) -> str:
    return "".join(chr(97 + t % 26) for t in tokens)


def flipped(prompt: list[int], n: int, at: int) -> list[int]:
    """The greedy tokens, but the other token of the near tie at position `at`, greedy again from there."""
    ref = greedy(prompt, n)
    head = [*ref[:at], best([*prompt, *ref[:at]])[1]]
    return head + greedy([*prompt, *head], n - at - 1)


async def referenced(worker: ToyWorker, api: str, prompt: list[int], received: Any) -> RequestRecord:
    r = RequestRecord("r", api, "short", started=0.0, deadline_s=30.0, outcome="ok", ended=1.0)
    r.prompt, r.max_tokens, r.received = prompt, 12, [received]
    r.expected = None
    with patch.object(worker_pb2_grpc, "WorkerServiceStub", lambda _ch: worker):
        await fill_references("127.0.0.1:1", [r])
    return r


def tie_position(prompt: list[int], n: int) -> int:
    ref = greedy(prompt, n)
    return next(i for i in range(n) if len(best([*prompt, *ref[:i]])) == 2)


async def test_a_difference_counts_as_a_tie_flip_only_when_a_near_tie_and_the_greedy_rest_explain_it() -> None:
    worker, prompt = ToyWorker(), [5]
    k = tie_position(prompt, 12)
    turned = flipped(prompt, 12, k)
    r = await referenced(worker, "grpc", prompt, turned)
    assert verdict(r) == "wrong_tokens"  # the tie alone excuses nothing
    with patch.object(worker_pb2_grpc, "WorkerServiceStub", lambda _ch: worker):
        assert await confirm_flips("127.0.0.1:1", [r], lambda p, t: letters(t)) == 1
    assert r.flips == [[k]] and verdict(r) == "tie_flip"
    assert worker.calls[-1] == [*prompt, *turned[: k + 1]]  # the rest recomputed from the turned token

    off_path = [*turned[:-1], turned[-1] + 2]  # the flip, then a token the greedy rest does not give
    elsewhere = [*greedy(prompt, 12)[:k], 77, *greedy(prompt, 12)[k + 1 :]]  # another token, not the tie's
    bad = [await referenced(worker, "grpc", prompt, got) for got in (off_path, elsewhere)]
    with patch.object(worker_pb2_grpc, "WorkerServiceStub", lambda _ch: worker):
        assert await confirm_flips("127.0.0.1:1", bad, lambda p, t: letters(t)) == 0
    assert [verdict(b) for b in bad] == ["wrong_tokens", "wrong_tokens"]


async def test_an_http_text_is_a_tie_flip_when_the_turned_tokens_rebuild_it_exactly() -> None:
    worker, prompt = ToyWorker(), [5]
    k = tie_position(prompt, 12)
    good = await referenced(worker, "http", prompt, letters(flipped(prompt, 12, k)))
    wrong = await referenced(worker, "http", prompt, letters(flipped(prompt, 12, k)) + "z")
    assert good.expected == [letters(greedy(prompt, 12))] and good.reference_tokens == [greedy(prompt, 12)]
    with patch.object(worker_pb2_grpc, "WorkerServiceStub", lambda _ch: worker):
        assert await confirm_flips("127.0.0.1:1", [good, wrong], lambda p, t: letters(t)) == 1
    assert (verdict(good), verdict(wrong)) == ("tie_flip", "wrong_tokens")
    # a text rebuilder that does not give the reference's own text confirms nothing
    again = await referenced(worker, "http", prompt, letters(flipped(prompt, 12, k)))
    with patch.object(worker_pb2_grpc, "WorkerServiceStub", lambda _ch: worker):
        assert await confirm_flips("127.0.0.1:1", [again], lambda p, t: letters(t).upper()) == 0
    assert verdict(again) == "wrong_tokens"
