"""The router's output guardrails on a request's stream of `Chunk`s (the rules: `kvmesh.security.guardrails`).

Each chunk's text goes through the tenant's rules of the set in force at that chunk (`OutputGuard.rules`,
swapped by `GuardrailsWatch`), so a running stream obeys new rules from its next chunk. Text that could still
be the start of a match is held back (with its token ids) and sent with a later chunk, or with the last one.
A `stop` match ends the stream: the text before the match is sent with `FINISH_REASON_CONTENT_FILTER` (HTTP:
`content_filter`), the worker call is cancelled, and usage counts the tokens the engine generated so far.
Usage of a stream that ends normally is the engine's, unchanged; token ids are the engine's too (a `mask`
changes text only).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field

from kvmesh.core.generation import PositionLogprobs
from kvmesh.security.guardrails import GuardedStep, GuardedTokens, Match, RuleSet, TenantRules
from kvmesh.services.router import metrics as m
from kvmesh.services.router.core import Chunk
from kvmesh.v1 import common_pb2

log = logging.getLogger(__name__)


class OutputGuard:
    """The rules in force (None: guardrails off, chunks pass untouched) and the per-stream filter."""

    def __init__(self, rules: RuleSet | None = None) -> None:
        self.rules = rules

    def swap(self, rules: RuleSet) -> None:
        self.rules = rules

    async def filter(
        self, chunks: AsyncGenerator[Chunk, None], request_id: str, tenant: str, n_prompt: int, n: int = 1
    ) -> AsyncGenerator[Chunk, None]:
        """`chunks` through the rules (see the module docstring); closing this closes `chunks`.

        Each of a request's `n` sequences (`Chunk.index`) is filtered on its own: a `stop` ends that sequence
        (the worker call is cancelled once every sequence has ended), the others go on."""
        seqs: dict[int, _Sequence] = {}
        n_tokens = 0
        last: Chunk | None = None
        try:
            async for c in chunks:
                last = c
                n_tokens += len(c.token_ids)
                seq = seqs.setdefault(c.index, _Sequence())
                if seq.ended:  # stopped by a rule: the engine's further tokens of it are dropped
                    if c.usage is not None:
                        yield _usage_only(c)
                        return
                    continue
                final = bool(c.finish_reason)
                seq.logprobs.extend(c.logprobs)
                step = seq.tokens.step(c.token_ids, c.text, self._tenant_rules(tenant), final)
                _count(step.matches)
                if step.stopped is not None:
                    log.info("request %s: guardrail rule %r ended a sequence", request_id, step.stopped.name)
                    seq.ended = True
                    done = len(seqs) >= n and all(s.ended for s in seqs.values())
                    usage = c.usage or (_usage(n_prompt, n_tokens) if done else None)
                    yield _out(step, c, seq, common_pb2.FINISH_REASON_CONTENT_FILTER, usage)
                    if done:
                        return
                    continue
                seq.ended = final
                if step.text or step.token_ids or final or c.usage is not None:
                    yield _out(step, c, seq, c.finish_reason, c.usage)
                if c.usage is not None:
                    return
            for index, seq in seqs.items():  # ended without a finish reason: what each sequence held back
                tail = seq.tokens.step([], "", self._tenant_rules(tenant), final=True)
                if last is not None and not seq.ended and (tail.text or tail.token_ids):
                    yield _out(tail, _at(last, index), seq, common_pb2.FINISH_REASON_UNSPECIFIED, None)
        finally:
            await chunks.aclose()  # a stop, or the client gone: the worker call is cancelled

    def _tenant_rules(self, tenant: str) -> TenantRules:
        assert self.rules is not None  # `filter` runs only with guardrails on
        return self.rules.for_tenant(tenant)


@dataclass(slots=True)
class _Sequence:
    """One sequence's filter state: its held-back tokens, their log-probabilities (in the same order: the
    filter releases tokens first in, first out), and whether it has ended."""

    tokens: GuardedTokens = field(default_factory=GuardedTokens)
    logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    ended: bool = False


def _usage(n_prompt: int, n_tokens: int) -> common_pb2.Usage:
    """What the engine generated up to a stop: the worker's own usage never comes (its call is cancelled)."""
    return common_pb2.Usage(prompt_tokens=n_prompt, completion_tokens=n_tokens)


def _at(c: Chunk, index: int) -> Chunk:
    return dataclasses.replace(c, index=index, logprobs=(), prompt_logprobs=())


def _usage_only(c: Chunk) -> Chunk:
    return Chunk([], "", c.worker_id, c.migrations, common_pb2.FINISH_REASON_UNSPECIFIED, c.usage, c.index)


def _out(step: GuardedStep, c: Chunk, seq: _Sequence, finish: int, usage: common_pb2.Usage | None) -> Chunk:
    released = len(step.token_ids) if seq.logprobs else 0
    logprobs, seq.logprobs[:released] = tuple(seq.logprobs[:released]), []
    return Chunk(
        list(step.token_ids), step.text, c.worker_id, c.migrations, finish, usage, c.index, logprobs, c.prompt_logprobs
    )


def _count(matches: Sequence[Match]) -> None:
    for x in matches:
        m.GUARDRAIL_MATCHES.labels(x.rule.name, x.rule.action.value).inc()
