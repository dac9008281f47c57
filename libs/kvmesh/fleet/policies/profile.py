"""Policies that are routing profiles of ``kvmesh.routing`` (the real pipeline code, unchanged).

* kvmesh: ``Profile.default()`` (``kvmesh/routing/default_profile.yaml``), or any YAML profile given by path
  (a tuned profile is reported as such), with the router's ``InflightTracker`` for in-flight accounting.
* round_robin / random / least_loaded: ``Profile.baseline(picker)`` (health filters + one baseline picker).

Load reports are taken at decision time (zero report lag), so the tracker's in-flight sums only add
``inflight_requests`` (used by the anti-herding tie-break); work is never counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from kvmesh.fleet.policies.base import Policy
from kvmesh.routing.inflight import InflightTracker
from kvmesh.routing.profile import Profile
from kvmesh.routing.types import RoutingQuery, WorkerView


class ProfilePolicy(Policy):
    """Decides with a ``kvmesh.routing.profile.Profile`` built by ``factory(seed)`` at every reset."""

    def __init__(self, name: str, factory: Callable[[int], Profile]) -> None:
        self.name = name
        self._factory = factory
        self.profile = factory(0)
        self.tracker = InflightTracker()

    def reset(self, worker_ids: Sequence[str], seed: int) -> None:
        self.profile = self._factory(seed)
        self.tracker = InflightTracker()

    def choose(self, req: RoutingQuery, workers: Sequence[WorkerView], now: float) -> str:
        for w in workers:
            self.tracker.on_report(w.id, w.report_ts)
        self.tracker.apply(workers)
        d = self.profile.decide(req, workers)
        if d.worker_id is None:  # every worker filtered out (e.g. all KV-full): least queued wins
            return min(workers, key=lambda w: (w.waiting, w.running)).id
        return d.worker_id

    def on_routed(self, req: RoutingQuery, worker_id: str, now: float) -> None:
        new = max(req.prompt_tokens - covered_blocks(req, worker_id) * req.block_size, 0)
        self.tracker.assign(req.request_id, worker_id, new, req.prompt_tokens, req.block_size, now)

    def on_first_token(self, request_id: str, worker_id: str, now: float) -> None:
        self.tracker.first_token(request_id)

    def on_finish(self, request_id: str, worker_id: str, now: float) -> None:
        self.tracker.finish(request_id)


def covered_blocks(req: RoutingQuery, worker_id: str) -> int:
    """Leading blocks ``worker_id`` will not prefill: its GPU hit, or with a data plane what its tiers hold and,
    with peer pulls, the longest prefix any worker holds (the in-flight estimate; the sim decides the pull)."""
    m = req.matches.get(worker_id, 0)
    if not req.tier_matches:
        return m
    m = max(m, req.tier_matches.get(worker_id, 0))
    return max(m, *req.tier_matches.values()) if req.peer_pulls else m


def kvmesh_policy(profile_path: str | Path | None = None) -> ProfilePolicy:
    """The kvmesh default profile, or the YAML profile at ``profile_path``; it pulls from peers when the fleet
    has a KV data plane."""
    if profile_path is None:
        pol = ProfilePolicy("kvmesh", lambda seed: Profile.default(seed=seed))
    else:
        text = Path(profile_path).read_text()
        pol = ProfilePolicy("kvmesh", lambda seed: Profile.from_yaml(text, seed=seed))
    pol.peer_pulls = True
    return pol


def baseline_policy(name: str) -> ProfilePolicy:
    """round_robin / random / least_loaded as ``Profile.baseline``."""
    picker = name.replace("_", "-")
    return ProfilePolicy(name, lambda seed: Profile.baseline(picker, seed=seed))
