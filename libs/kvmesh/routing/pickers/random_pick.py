"""Random baseline: pick uniformly among the candidates (seeded RNG; ignores costs and the index)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvmesh.routing.plugin import PICKERS, register
from kvmesh.routing.types import RoutingQuery, WorkerView


@register(PICKERS, "random")
class RandomPicker:
    """pick ~ Uniform{0, …, n-1}"""

    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self.rng = random.Random(seed)

    def pick(self, req: RoutingQuery, candidates: Sequence[WorkerView], totals: Sequence[float]) -> int:
        return self.rng.randrange(len(candidates))
