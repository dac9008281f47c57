"""Decode load: the decode work (KV tokens of running sequences) on worker w.

    D(w) = decode_tokens_active(w) + inflight_decode_tokens(w)
    cost(w) = D(w) / max(max_c D(c), 1)          over the candidates c  → in [0, 1]

decode_tokens_active comes from the worker's last load report; inflight_decode_tokens is the KV this
router's own assignments since that report will hold (their prompt tokens, counted from assignment on, so a
burst of decisions between two load reports already sees each other).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.plugin import SCORERS, register
from kvmesh.routing.types import RoutingQuery, WorkerView


def decode_tokens(w: WorkerView) -> int:
    """D(w) = decode_tokens_active(w) + inflight_decode_tokens(w)."""
    return w.decode_tokens_active + w.inflight_decode_tokens


@register(SCORERS, "decode-load")
class DecodeLoadScorer:
    """cost(w) = D(w) / max_c D(c)"""

    name = "decode-load"

    def score(
        self, req: RoutingQuery, candidates: Sequence[WorkerView], all_workers: Sequence[WorkerView]
    ) -> list[float]:
        raw = [w.decode_tokens_active + w.inflight_decode_tokens for w in candidates]
        scale = max(max(raw, default=0), 1)
        return [r / scale for r in raw]
