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

import logging
from collections.abc import AsyncGenerator, Sequence

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
        self, chunks: AsyncGenerator[Chunk, None], request_id: str, tenant: str, n_prompt: int
    ) -> AsyncGenerator[Chunk, None]:
        """`chunks` through the rules (see the module docstring); closing this closes `chunks`."""
        g = GuardedTokens()
        n_tokens = 0
        last: Chunk | None = None
        try:
            async for c in chunks:
                last = c
                n_tokens += len(c.token_ids)
                final = bool(c.finish_reason)
                step = g.step(c.token_ids, c.text, self._tenant_rules(tenant), final)
                _count(step.matches)
                if step.stopped is not None:
                    log.info("request %s: guardrail rule %r ended the stream", request_id, step.stopped.name)
                    usage = common_pb2.Usage(prompt_tokens=n_prompt, completion_tokens=n_tokens)
                    yield _out(step, c, common_pb2.FINISH_REASON_CONTENT_FILTER, c.usage or usage)
                    return
                if step.text or step.token_ids or final:
                    yield _out(step, c, c.finish_reason, c.usage)
                if final:
                    return
            tail = g.step([], "", self._tenant_rules(tenant), final=True)  # ended without a finish reason
            if last is not None and (tail.text or tail.token_ids):
                yield _out(tail, last, common_pb2.FINISH_REASON_UNSPECIFIED, None)
        finally:
            await chunks.aclose()  # a stop, or the client gone: the worker call is cancelled

    def _tenant_rules(self, tenant: str) -> TenantRules:
        assert self.rules is not None  # `filter` runs only with guardrails on
        return self.rules.for_tenant(tenant)


def _out(step: GuardedStep, c: Chunk, finish: int, usage: common_pb2.Usage | None) -> Chunk:
    return Chunk(step.token_ids, step.text, c.worker_id, c.migrations, finish, usage)


def _count(matches: Sequence[Match]) -> None:
    for x in matches:
        m.GUARDRAIL_MATCHES.labels(x.rule.name, x.rule.action.value).inc()
