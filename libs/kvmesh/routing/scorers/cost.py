"""The default routing cost: prefill cost and decode load on one shared token scale.

    P(w)    = max(prompt - overlap(w), 0) + prefill_tokens_queued(w) + inflight_prefill_tokens(w)
    D(w)    = decode_tokens_active(w) + inflight_decode_tokens(w)
    S       = max(max_c P(c), max_c D(c), 1)                      over the candidates c
    alpha   = prefill_weight / (prefill_weight + decode_weight)
    cost(w) = alpha · P(w)/S + (1 - alpha) · D(w)/S

Both terms are in tokens and divided by the *same* S, so the ranking is that of alpha·P + (1-alpha)·D
in tokens. This matters for herding: with per-term normalisation (each term divided by its own max) the
cached worker's decode term is capped at 1 however loaded it gets, and for alpha ≥ 0.5 a shared system
prompt would send every request to it. On a shared scale each request added to w raises D(w) by its
prompt length, so w stops winning once (1-alpha)·D(w) exceeds alpha·(tokens another worker would
prefill): at most about alpha/(1-alpha) extra requests per worker before the others are preferred.
`set_weights` changes alpha at run time.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.plugin import SCORERS, register
from kvmesh.routing.types import RouteRequest, WorkerView


@register(SCORERS, "cost")
class CostScorer:
    """cost(w) = (alpha·P(w) + (1-alpha)·D(w)) / S"""

    name = "cost"

    def __init__(self, prefill_weight: float = 0.5, decode_weight: float = 0.5) -> None:
        self.alpha = 0.5
        self.set_weights(prefill_weight, decode_weight)

    def set_weights(self, prefill_weight: float, decode_weight: float) -> None:
        """alpha = prefill_weight / (prefill_weight + decode_weight); both ≥ 0, not both 0."""
        if prefill_weight < 0 or decode_weight < 0 or prefill_weight + decode_weight <= 0:
            raise ValueError("weights must be >= 0 and not both 0")
        self.alpha = prefill_weight / (prefill_weight + decode_weight)

    def score(
        self, req: RouteRequest, candidates: Sequence[WorkerView], all_workers: Sequence[WorkerView]
    ) -> list[float]:
        a = self.alpha
        b = 1.0 - a
        prompt = req.prompt_tokens
        bs = req.block_size
        matches = req.matches
        ps: list[int] = []
        ds: list[int] = []
        scale = 1
        for w in candidates:
            m = matches.get(w.id, 0)
            new = prompt - m * bs if m else prompt
            p = (new if new > 0 else 0) + w.prefill_tokens_queued + w.inflight_prefill_tokens
            d = w.decode_tokens_active + w.inflight_decode_tokens
            ps.append(p)
            ds.append(d)
            if p > scale:
                scale = p
            if d > scale:
                scale = d
        inv = 1.0 / scale
        return [(a * p + b * d) * inv for p, d in zip(ps, ds, strict=True)]
