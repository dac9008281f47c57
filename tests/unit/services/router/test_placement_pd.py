"""Placement's prefill/decode path: on a fleet with prefill workers, a request with a long uncached prompt is
disaggregated (its prefill half named, the decode worker chosen), a short one runs aggregated on a worker that
decodes, a prefill worker never gets an aggregated request, a retry (`pd` off) is aggregated, and without
prefill workers nothing changes; each decision is counted by mode and reason."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
from prometheus_client import REGISTRY

from kvmesh.core.handoff import WorkerRole
from kvmesh.replica.media import PrefixMatches
from kvmesh.routing import InflightTracker, Profile, WorkerView
from kvmesh.routing.dataplane import transfer_costs
from kvmesh.routing.disagg import PdParams
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.services.router.placement import Placement
from kvmesh.services.router.workers import WorkerPool

pytestmark = pytest.mark.unit
BS = 16


class Pool:
    def __init__(self, views: list[WorkerView]) -> None:
        self._views = views

    async def settle(self) -> None:  # every worker known from the start
        return None

    def views(self, now: float) -> list[WorkerView]:
        return self._views


class Index:
    async def lookup(self, hashes: Any, tenant: str = "", lora: str = "", token_ids: Any = None) -> PrefixMatches:
        return PrefixMatches({}, {})


def view(wid: str, role: WorkerRole) -> WorkerView:
    return WorkerView(wid, role=role, kvsync_address="127.0.0.1:1", tier_region="cpu", transfer=transfer_costs(BS))


def placement(views: list[WorkerView], pd: bool = True) -> Placement:
    pool, index = cast(WorkerPool, Pool(views)), cast(IndexReplica, Index())
    p = Placement(Profile.default(seed=1), pool, index, InflightTracker(), BS, "tiny")
    p.pd_params = PdParams(min_uncached_tokens=256) if pd else None
    return p


def prompt(n: int) -> np.ndarray:
    return np.array([(i % 1000) + 3 for i in range(n)], dtype=np.uint32)


def decisions(mode: str, reason: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_pd_decisions_total", {"mode": mode, "reason": reason}) or 0.0


async def test_a_long_uncached_prompt_is_disaggregated() -> None:
    p = placement([view("p0", WorkerRole.PREFILL), view("d0", WorkerRole.DECODE)])
    before = decisions("disaggregated", "disaggregate")
    routed = await p.route("r1", prompt(40 * BS + 3), "", set(), pd=True)
    assert routed.prefill is not None and routed.prefill.worker_id == "p0"
    assert routed.prefill.n_new == 40 * BS + 3  # nothing cached on the prefill worker
    assert routed.worker_id == "d0"
    assert routed.overlap == 40 * BS  # the handoff covers every block but the last token's
    assert decisions("disaggregated", "disaggregate") == before + 1


async def test_a_short_prompt_runs_aggregated_on_a_decode_worker() -> None:
    p = placement([view("p0", WorkerRole.PREFILL), view("d0", WorkerRole.DECODE)])
    before = decisions("aggregated", "short-prefill")
    routed = await p.route("r2", prompt(100), "", set(), pd=True)
    assert routed.prefill is None and routed.worker_id == "d0"
    assert decisions("aggregated", "short-prefill") == before + 1


async def test_a_prefill_worker_never_serves_an_aggregated_request() -> None:
    views = [view("p0", WorkerRole.PREFILL), view("p1", WorkerRole.PREFILL), view("d0", WorkerRole.DECODE)]
    p = placement(views)
    for i in range(20):  # the profile would spread some of these over three idle workers
        routed = await p.route(f"r{i}", prompt(40 * BS), "", set(), pd=False)
        assert routed.prefill is None and routed.worker_id == "d0"


async def test_without_prefill_workers_every_request_is_aggregated_and_uncounted() -> None:
    p = placement([view("a", WorkerRole.BOTH), view("b", WorkerRole.BOTH)])
    before = sum(decisions(m, r) for m in ("aggregated", "disaggregated") for r in ("no-prefill-pool", "disaggregate"))
    routed = await p.route("r3", prompt(40 * BS), "", set(), pd=True)
    assert routed.prefill is None and routed.worker_id in ("a", "b")
    after = sum(decisions(m, r) for m in ("aggregated", "disaggregated") for r in ("no-prefill-pool", "disaggregate"))
    assert after == before


async def test_p_d_off_routes_aggregated_on_decode_workers() -> None:
    p = placement([view("p0", WorkerRole.PREFILL), view("d0", WorkerRole.DECODE)], pd=False)
    routed = await p.route("r4", prompt(40 * BS), "", set(), pd=True)
    assert routed.prefill is None and routed.worker_id == "d0"


async def test_an_excluded_prefill_worker_leaves_the_request_aggregated() -> None:
    """The fallback after a failed prefill half: routed again with the prefill worker excluded."""
    p = placement([view("p0", WorkerRole.PREFILL), view("d0", WorkerRole.DECODE)])
    routed = await p.route("r5", prompt(40 * BS), "", {"p0"}, pd=True)
    assert routed.prefill is None and routed.worker_id == "d0"
