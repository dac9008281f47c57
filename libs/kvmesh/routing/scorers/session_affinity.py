"""Session affinity: a session id sticks to one worker through a consistent-hash ring.

    owner(s) = first worker clockwise from xxh64(s) on the ring of all known workers that is a candidate
    cost(w)  = 0 if w == owner(session_id) else 1        (all 0 when the request has no session id)

The ring holds every known worker (not only today's candidates), so a worker filtered out for a moment
(circuit open, KV full) sends its sessions to their next ring owner and gets them back afterwards, and a
worker leaving the fleet moves only its own ~1/N of the sessions. With a weight larger than the spread of
the other costs, affinity dominates; with a smaller weight it only breaks near-ties.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.routing.plugin import SCORERS, register
from kvmesh.routing.ring import HashRing
from kvmesh.routing.types import RoutingQuery, WorkerView


@register(SCORERS, "session-affinity")
class SessionAffinityScorer:
    """cost(w) = [w ≠ owner(session)]"""

    name = "session-affinity"

    def __init__(self, vnodes: int = 128) -> None:
        self.ring = HashRing(vnodes=vnodes)
        self._known: tuple[str, ...] = ()

    def owner(self, session_id: str, candidates: Sequence[WorkerView], all_workers: Sequence[WorkerView]) -> str | None:
        known = tuple(w.id for w in all_workers)
        if known != self._known:
            self.ring.sync(known)
            self._known = known
        return self.ring.lookup(session_id, {w.id for w in candidates})

    def score(
        self, req: RoutingQuery, candidates: Sequence[WorkerView], all_workers: Sequence[WorkerView]
    ) -> list[float]:
        if not req.session_id:
            return [0.0] * len(candidates)
        o = self.owner(req.session_id, candidates, all_workers)
        return [0.0 if w.id == o else 1.0 for w in candidates]
