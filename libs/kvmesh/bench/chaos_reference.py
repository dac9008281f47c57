"""The reference run of a campaign on real vLLM workers (`python -m kvmesh.bench chaos --vllm`).

A simulated engine's tokens are a pure function of the request (`chaos_check.reference_tokens`); a real
engine's are not known before it runs. So with vLLM workers every request of the campaign is greedy, and
after the last fault, on the settled suite, each distinct (prompt, max_tokens) the campaign sent is sent once
more, straight to one worker's Generate with no fault anywhere: that answer is the request's `expected`
(for the HTTP requests its text, as the worker detokenises it for the router). A greedy sequence
continues the same way wherever it runs and however often it is resumed, so every request the campaign saw
succeed must equal it.

Greedy is exact only up to the engine's arithmetic: the same prompt computed in another batch (or from KV
pulled from another worker's tier) sums its floats in another order, and where the two most likely tokens lie
within `chaos_check.TIE_NATS` the pick may go either way. The reference asks for the `TOP_LOGPROBS` most
likely tokens at each position; `RequestRecord.ties` keeps, per near tie, the tokens within the bound of the
most likely, and a succeeded request whose first difference is between two of them counts as a
``tie_flip``, reported apart from ``wrong_tokens``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc.aio

from kvmesh.bench.chaos_check import TIE_NATS, RequestRecord
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

REFERENCE_IN_FLIGHT = 8
REFERENCE_TIMEOUT_S = 120.0
TOP_LOGPROBS = 4  # the most likely tokens the reference asks for at each position: a tie of up to this many


def near_ties(steps: Sequence[common_pb2.PositionLogprobs], offset: int = 0) -> dict[int, list[int]]:
    """Position -> the tokens within `TIE_NATS` of the most likely, where there are two or more (pure). The
    best is taken by log-probability, not by the order or rank the engine lists them in."""
    ties: dict[int, list[int]] = {}
    for i, step in enumerate(steps):
        if len(step.top) < 2:
            continue
        listed = {t.token_id: t.logprob for t in (*step.top, step.token)}  # the pick, were it not among the top
        best = max(listed.values())
        tied = [tid for tid, lp in listed.items() if best - lp <= TIE_NATS]
        if len(tied) >= 2:
            ties[offset + i] = tied
    return ties


async def reference(
    stub: worker_pb2_grpc.WorkerServiceStub, rid: str, prompt: Sequence[int], max_tokens: int
) -> tuple[list[int], str, dict[int, list[int]]]:
    """The worker's greedy tokens for `prompt`, their text (the worker's own detokenisation, with the prompt
    as context, as the router's HTTP answers carry it) and their near ties."""
    req = worker_pb2.GenerateRequest(
        request_id=rid,
        token_ids=common_pb2.TokenIds(ids=list(prompt)),
        sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP_LOGPROBS
        ),
        detokenize=True,
    )
    tokens: list[int] = []
    text: list[str] = []
    ties: dict[int, list[int]] = {}
    async for m in stub.Generate(req, timeout=REFERENCE_TIMEOUT_S):
        if m.index != 0:
            continue
        ties |= near_ties(m.logprobs, len(tokens))
        tokens.extend(m.token_ids)
        text.append(m.text)
    if len(tokens) != max_tokens:
        raise RuntimeError(f"reference {rid}: {len(tokens)} of {max_tokens} tokens")
    return tokens, "".join(text), ties


async def fill_references(address: str, records: Sequence[RequestRecord]) -> int:
    """Sets `expected` and `ties` of every record that has no reference yet, from the worker at `address`;
    returns how many distinct requests were run."""
    groups: dict[tuple[tuple[int, ...], int], list[RequestRecord]] = {}
    for r in records:
        if r.expected is None:
            groups.setdefault((tuple(r.prompt), r.max_tokens), []).append(r)
    gate = asyncio.Semaphore(REFERENCE_IN_FLIGHT)
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)

        async def one(k: int, prompt: tuple[int, ...], max_tokens: int, rs: list[RequestRecord]) -> None:
            async with gate:
                tokens, text, ties = await reference(stub, f"chaos-reference-{k}", prompt, max_tokens)
            for r in rs:
                if r.api == "http":
                    r.expected, r.ties = [text], []
                else:
                    r.expected, r.ties = [list(tokens) for _ in range(r.n)], [dict(ties) for _ in range(r.n)]

        await asyncio.gather(*(one(k, p, m, rs) for k, ((p, m), rs) in enumerate(groups.items())))
    return len(groups)
