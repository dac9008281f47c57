"""Plugin interfaces of the pipeline (filters → scorers → picker) and the registry that YAML names map to.

Modelled on llm-d's scheduler plugins, with one convention of our own: **every scorer returns a cost in
roughly [0, 1], lower is better**. "Goodness" scores (decode capability, node health) are turned into a cost
as `1 - score` inside the scorer, so the pipeline's combined value is always

    total(w) = Σ_s weight_s · cost_s(w)

and the picker minimises it. (An argmax over Σ weight·score is the same choice, so one picker suffices.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from kvmesh.routing.types import RoutingQuery, WorkerView


@runtime_checkable
class Filter(Protocol):
    """Keeps the workers that may serve the request. Must not mutate its inputs."""

    name: str

    def filter(self, req: RoutingQuery, workers: Sequence[WorkerView]) -> Sequence[WorkerView]: ...


@runtime_checkable
class Scorer(Protocol):
    """Returns one cost per candidate (same order), lower is better, normalised to about [0, 1].

    `all_workers` is every known worker (before filtering), for scorers that need a stable population
    (the session ring).
    """

    name: str

    def score(
        self, req: RoutingQuery, candidates: Sequence[WorkerView], all_workers: Sequence[WorkerView]
    ) -> list[float]: ...


@runtime_checkable
class Picker(Protocol):
    """Chooses the index of one candidate given the combined costs (`totals` may be ignored by baselines)."""

    name: str

    def pick(self, req: RoutingQuery, candidates: Sequence[WorkerView], totals: Sequence[float]) -> int: ...


Factory = Callable[..., Any]

FILTERS: dict[str, Factory] = {}
SCORERS: dict[str, Factory] = {}
PICKERS: dict[str, Factory] = {}


def register(registry: dict[str, Factory], type_name: str) -> Callable[[Factory], Factory]:
    """Class decorator: make `type_name` usable in a YAML profile for the given registry."""

    def deco(cls: Factory) -> Factory:
        registry[type_name] = cls
        return cls

    return deco
