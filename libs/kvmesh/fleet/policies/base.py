"""The policy interface of the fleet simulator.

A policy sees, per request, the pipeline's :class:`~kvmesh.routing.types.RoutingQuery` (prompt length,
block hashes, per-worker prefix matches from the simulated cache-manager index, session id) and one
:class:`~kvmesh.routing.types.WorkerView` per worker (the engine's load report at decision time). It returns
a worker id. Hooks tell it what happened afterwards, so policies that keep their own router-side state
(Dynamo's active sequences, SGLang's approximate tree and load counters) can be reproduced faithfully.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.types import RoutingQuery, WorkerView


class Policy:
    """Base class: no-op hooks; subclasses implement :meth:`choose`."""

    name = "policy"
    # With a KV data plane: route on tier contents (RoutingQuery.tier_matches) and pull from peers (kvmesh).
    # Without it a policy's workers still load from their own tiers, routing as their router does.
    peer_pulls = False

    def reset(self, worker_ids: Sequence[str], seed: int) -> None:
        """Forget all state before a run over ``worker_ids``."""

    def choose(self, req: RoutingQuery, workers: Sequence[WorkerView], now: float) -> str:
        raise NotImplementedError

    def on_routed(self, req: RoutingQuery, worker_id: str, now: float) -> None:
        """The request was sent to ``worker_id``."""

    def on_first_token(self, request_id: str, worker_id: str, now: float) -> None:
        """The request's prefill finished (first token out)."""

    def on_finish(self, request_id: str, worker_id: str, now: float) -> None:
        """The request completed."""


def load_of(w: WorkerView) -> int:
    """Queue length as a load report gives it: running + waiting requests."""
    return w.running + w.waiting
