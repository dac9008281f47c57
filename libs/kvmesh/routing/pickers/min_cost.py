"""Min-cost picker with an anti-herding tie-break (the default picker).

    best   = min_i total(i)
    band   = { i : total(i) ≤ best + epsilon }                 (near-ties; costs are normalised to ~[0, 1])
    sample = `choices` distinct members of band, drawn at random (power-of-d-choices, d = 2 by default)
    pick   = argmin over sample of (inflight_requests(i), total(i))

Why: many requests that share a system prompt see (almost) the same costs, and a plain argmin sends them
all to the same worker until the next load report. Counting this router's own in-flight requests in the
tie-break spreads them, and drawing the sample at random keeps several router replicas — each of which only
sees its own in-flight requests — from all choosing the same worker. `tie_break: hash` derives the draw from
xxh64(request_id, seed) instead of a seeded RNG (reproducible per request); `epsilon: 0` gives plain argmin
with random tie-break among exact ties. Argmax of a "goodness" score is argmin of its cost, so no separate
argmax picker is needed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import xxhash

from kvmesh.routing.plugin import PICKERS, register
from kvmesh.routing.types import RoutingQuery, WorkerView


@register(PICKERS, "min-cost")
class MinCostPicker:
    """pick = argmin_{i ∈ sample(band, d)} (inflight_requests(i), total(i)), band = {total ≤ best + ε}"""

    name = "min-cost"

    def __init__(
        self, epsilon: float = 0.02, choices: int = 2, tie_break: str = "random", seed: int | None = None
    ) -> None:
        if epsilon < 0:
            raise ValueError("epsilon must be >= 0")
        if choices < 1:
            raise ValueError("choices must be >= 1")
        if tie_break not in ("random", "hash"):
            raise ValueError("tie_break must be random or hash")
        self.epsilon = epsilon
        self.choices = choices
        self.tie_break = tie_break
        self.seed = 0 if seed is None else seed
        self.rng = random.Random(seed)

    def pick(self, req: RoutingQuery, candidates: Sequence[WorkerView], totals: Sequence[float]) -> int:
        n = len(totals)
        if n == 1:
            return 0
        limit = min(totals) + self.epsilon
        band = [i for i in range(n) if totals[i] <= limit]
        if len(band) == 1:
            return band[0]
        rng = self.rng
        if self.tie_break == "hash":
            rng = random.Random(xxhash.xxh64_intdigest(req.request_id.encode(), seed=self.seed))
        sample = rng.sample(band, self.choices) if len(band) > self.choices else band
        if len(band) <= self.choices:
            rng.shuffle(sample)
        best = sample[0]
        best_key = (candidates[best].inflight_requests, totals[best])
        for i in sample[1:]:
            key = (candidates[i].inflight_requests, totals[i])
            if key < best_key:
                best, best_key = i, key
        return best
