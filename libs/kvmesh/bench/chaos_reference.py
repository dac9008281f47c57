"""The reference run of a campaign on real vLLM workers (`python -m kvmesh.bench chaos --vllm`).

A simulated engine's tokens are a pure function of the request (`chaos_check.reference_tokens`); a real
engine's are not known before it runs. So with vLLM workers every request of the campaign is greedy, and
after the last fault, on the settled suite, each distinct (prompt, max_tokens) the campaign sent is sent once
more, straight to one worker's Generate with no fault anywhere: that answer is the request's `expected`
(for the HTTP requests its text, as the worker detokenises it for the router). A greedy sequence
continues the same way wherever it runs and however often it is resumed, so every request the campaign saw
succeed must equal it.

Greedy is exact only up to the engine's arithmetic: the same prompt computed in another batch (or from KV
pulled from another worker's tier) sums its floats in another order, and where the most likely tokens lie
within `chaos_check.TIE_NATS` of each other the pick may go either way. The reference asks for the
`TOP_LOGPROBS` most likely tokens at each position and keeps the near ties (`RequestRecord.ties`). A
succeeded request that differs from it is then checked once more (`confirm_flips`): it counts as a
``tie_flip`` only if it took another token of a near tie and everything after is the greedy continuation
recomputed from that token (for token ids, up to `MAX_FLIPS` such turns; for an HTTP text, one turn, its
text rebuilt as the worker's detokenizer builds it, `WorkerText`). Anything else stays ``wrong_tokens``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc.aio

from kvmesh.bench.chaos_check import TIE_NATS, RequestRecord, verdict
from kvmesh.engine.cut_prompt_text import SentText
from kvmesh.engine.tokenizer import HfTokenizer
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

REFERENCE_IN_FLIGHT = 8
REFERENCE_TIMEOUT_S = 120.0
TOP_LOGPROBS = 4  # the most likely tokens the reference asks for at each position: a tie of up to this many
MAX_FLIPS = 3  # near-tie turns one token sequence may take and still count as a tie flip
TextOf = Callable[[Sequence[int], Sequence[int]], str]  # (prompt, tokens) -> the worker's text of the tokens


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
                    r.expected, r.reference_tokens, r.ties = [text], [list(tokens)], [dict(ties)]
                else:
                    r.expected, r.ties = [list(tokens) for _ in range(r.n)], [dict(ties) for _ in range(r.n)]

        await asyncio.gather(*(one(k, p, m, rs) for k, ((p, m), rs) in enumerate(groups.items())))
    return len(groups)


class WorkerText:
    """The text a vLLM worker sends for `tokens` generated after `prompt` (not resumed), rebuilt here with the
    worker's own `SentText`. `confirm_flips` checks it against the reference's own text before trusting it."""

    def __init__(self, model: str | Path) -> None:
        self._tok = HfTokenizer(model)

    def __call__(self, prompt: Sequence[int], tokens: Sequence[int]) -> str:
        sent = SentText(self._tok.backend, prompt)
        return "".join(sent.step(t) for t in tokens)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


async def _continuation(
    stub: worker_pb2_grpc.WorkerServiceStub, rid: str, context: Sequence[int], n: int
) -> tuple[list[int], dict[int, list[int]]]:
    """The greedy `n` tokens after `context` and their near ties (none for n = 0)."""
    if n <= 0:
        return [], {}
    tokens, _, ties = await reference(stub, rid, context, n)
    return tokens, ties


async def _flips_of_tokens(stub: worker_pb2_grpc.WorkerServiceStub, r: RequestRecord) -> list[int]:
    """The near-tie positions that explain `r`'s tokens (empty: they do not): at each difference, both tokens
    are of one near tie, and the reference is recomputed greedily from the received one."""
    assert r.expected is not None
    got, want, ties = list(r.received[0]), list(r.expected[0]), dict(r.ties[0])
    flips: list[int] = []
    for turn in range(MAX_FLIPS):
        k = _first_difference(want, got)
        if k is None:
            break
        tied = ties.get(k, [])
        if want[k] not in tied or got[k] not in tied:
            return []
        cont, cont_ties = await _continuation(
            stub, f"{r.rid}-flip-{turn}", [*r.prompt, *got[: k + 1]], len(got) - k - 1
        )
        want = [*got[: k + 1], *cont]
        ties = {i: t for i, t in ties.items() if i <= k} | {k + 1 + i: t for i, t in cont_ties.items()}
        flips.append(k)
    return flips if want == got and len(got) == r.max_tokens else []


async def _flips_of_text(stub: worker_pb2_grpc.WorkerServiceStub, r: RequestRecord, text_of: TextOf) -> list[int]:
    """The one near-tie position that explains `r`'s text (empty: none does, or `text_of` does not rebuild
    the reference's own text): the reference's tokens up to it, another token of the tie there, the greedy
    continuation after it, rebuilt as the worker's text, equal the received text."""
    assert r.expected is not None
    tokens, ties, got = r.reference_tokens[0], r.ties[0], r.received[0]
    if text_of(r.prompt, tokens) != r.expected[0]:
        log.warning("chaos: %s: the worker's text not rebuilt from its tokens; no flip confirmed", r.rid)
        return []
    for k in sorted(ties):
        if not got.startswith(text_of(r.prompt, tokens[:k])):
            break  # the text differs before this position: no later flip explains it
        for alt in ties[k]:
            if alt == tokens[k]:
                continue
            context = [*r.prompt, *tokens[:k], alt]
            cont, _ = await _continuation(stub, f"{r.rid}-flip-{k}-{alt}", context, r.max_tokens - k - 1)
            if text_of(r.prompt, [*tokens[:k], alt, *cont]) == got:
                return [k]
    return []


async def confirm_flips(address: str, records: Sequence[RequestRecord], text_of: TextOf) -> int:
    """Sets `flips` of each succeeded single-sequence record that differs from its reference where a near-tie
    turn explains it (see the module docstring); returns how many were confirmed."""
    todo = [
        r
        for r in records
        if r.outcome == "ok" and r.n == 1 and r.ties and r.expected is not None and verdict(r) not in ("", "hung")
    ]
    confirmed = 0
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        for r in todo:
            flips = await (_flips_of_text(stub, r, text_of) if r.api == "http" else _flips_of_tokens(stub, r))
            if flips:
                r.flips, confirmed = [flips], confirmed + 1
    return confirmed
