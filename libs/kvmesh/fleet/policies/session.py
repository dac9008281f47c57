"""Session-affinity baseline (round-robin, random and least-loaded are routing profiles: see profile.py).

* session: consistent-hash ring (``kvmesh.routing.ring.HashRing``) keyed by the session id; a request
  without a session id (the Mooncake trace has none) is keyed by the chained hash of its first
  ``key_tokens`` tokens (the block ending at that position, so it covers the trace's shared 512-token
  system block and the next one): prefix-hash affinity, as SGLang's ``prefix_hash`` policy.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.fleet.policies.base import Policy
from kvmesh.routing.ring import HashRing
from kvmesh.routing.types import RoutingQuery, WorkerView


class SessionAffinity(Policy):
    name = "session"

    def __init__(self, key_tokens: int = 1024, vnodes: int = 128) -> None:
        self.key_tokens = key_tokens
        self.vnodes = vnodes
        self._ring = HashRing(vnodes=vnodes)

    def reset(self, worker_ids: Sequence[str], seed: int) -> None:
        self._ring = HashRing(worker_ids, vnodes=self.vnodes)

    def key(self, req: RoutingQuery) -> str:
        if req.session_id:
            return req.session_id
        hs = list(req.block_hashes)
        if not hs:
            return req.request_id
        k = max(1, self.key_tokens // req.block_size)
        return f"p{hs[min(k, len(hs)) - 1]}"

    def choose(self, req: RoutingQuery, workers: Sequence[WorkerView], now: float) -> str:
        owner = self._ring.lookup(self.key(req), {w.id for w in workers})
        return owner if owner is not None else workers[0].id
