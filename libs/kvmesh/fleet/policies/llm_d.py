"""Re-implementation of llm-d's inference scheduler with its documented default weights.

Source: llm-d/llm-d-inference-scheduler (EPP plugins from kubernetes-sigs/gateway-api-inference-extension,
``pkg/epp/scheduling/framework/plugins/scorer/{prefix,queue,kvcache_utilization}``) and the llm-d
"precise prefix-cache aware" guide: scorers ``prefix-cache-scorer`` weight 3, ``queue-scorer`` weight 2,
``kv-cache-utilization-scorer`` weight 2, ``max-score-picker``. Each scorer returns a score in [0, 1],
higher is better:

    prefix(w) = matched_blocks(w) / total_blocks(request)     (precise variant: from KV events)
    queue(w)  = (q_max − q(w)) / (q_max − q_min), 1 if all equal; q = waiting requests
    kv(w)     = 1 − kv_usage(w)
    score(w)  = 3·prefix(w) + 2·queue(w) + 2·kv(w); argmax, ties uniformly at random
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvmesh.fleet.policies.base import Policy
from kvmesh.routing.types import RoutingQuery, WorkerView


class LlmD(Policy):
    name = "llm_d"

    def __init__(self, prefix_weight: float = 3.0, queue_weight: float = 2.0, kv_weight: float = 2.0) -> None:
        self.wp, self.wq, self.wk = prefix_weight, queue_weight, kv_weight
        self._rng = random.Random(0)

    def reset(self, worker_ids: Sequence[str], seed: int) -> None:
        self._rng = random.Random(seed)

    def scores(self, req: RoutingQuery, workers: Sequence[WorkerView]) -> list[float]:
        total = max(len(req.block_hashes), 1)
        qs = [w.waiting for w in workers]
        qmin, qmax = min(qs), max(qs)
        out = []
        for w, q in zip(workers, qs, strict=True):
            prefix = req.matches.get(w.id, 0) / total
            queue = 1.0 if qmax == qmin else (qmax - q) / (qmax - qmin)
            out.append(self.wp * prefix + self.wq * queue + self.wk * (1.0 - w.kv_usage))
        return out

    def choose(self, req: RoutingQuery, workers: Sequence[WorkerView], now: float) -> str:
        sc = self.scores(req, workers)
        best = max(sc)
        ties = [w.id for w, v in zip(workers, sc, strict=True) if v == best]
        return ties[0] if len(ties) == 1 else ties[self._rng.randrange(len(ties))]
