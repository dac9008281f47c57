"""Long/short pool filter: long prompts go to the "long" pool, short ones to the "short" pool.

    is_long(req) = prompt_tokens > long_prompt_tokens            (default 2048)
    keep(w)      = w.pool in ("", "long")   if is_long(req)
                   w.pool in ("", "short")  otherwise

Workers with `pool == ""` serve both. The filter is soft: if it would leave no candidate it returns its
input unchanged (a pool without live workers must not turn into an outage), unless `strict: true`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.plugin import FILTERS, register
from kvmesh.routing.types import RoutingQuery, WorkerView


@register(FILTERS, "pool")
class PoolFilter:
    """keep(w) = w.pool in {"", pool(req)}; pool(req) = "long" if prompt_tokens > threshold else "short"."""

    name = "pool"

    def __init__(self, long_prompt_tokens: int = 2048, strict: bool = False) -> None:
        if long_prompt_tokens < 1:
            raise ValueError("long_prompt_tokens must be >= 1")
        self.long_prompt_tokens = long_prompt_tokens
        self.strict = strict

    def filter(self, req: RoutingQuery, workers: Sequence[WorkerView]) -> Sequence[WorkerView]:
        want = "long" if req.prompt_tokens > self.long_prompt_tokens else "short"
        out = [w for w in workers if w.pool == "" or w.pool == want]
        if not out and not self.strict:
            return workers
        return out
