"""The live router prices tiers and pulls with the one pricer (`kvmesh.routing.dataplane.plan_prefix`): a
prefix held only in a worker's CPU tier is a tier load there; a drained holder's prefix is pulled by the
other worker with a hint from the chosen worker's plan; a worker serving no kv-sync is never a source; the
margin decides; a second request for the same prefix on that worker joins the first's pull (one pull)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pytest
from prometheus_client import REGISTRY

from kvmesh.replica.media import PrefixMatches
from kvmesh.routing import Decision, InflightTracker, Profile, RoutingQuery, WorkerView
from kvmesh.routing.dataplane import pull_seconds, transfer_costs
from kvmesh.services.router.index_replica import IndexReplica
from kvmesh.services.router.placement import Placement
from kvmesh.services.router.workers import WorkerPool
from kvmesh.wire.proto import pull_from_proto, pull_to_proto

pytestmark = pytest.mark.unit
BS = 16
N = 40
PROMPT = np.array([(i % 1000) + 3 for i in range(N * BS)], dtype=np.uint32)
COSTS = transfer_costs(BS)


class Pool:
    def __init__(self, views: list[WorkerView]) -> None:
        self._views = views

    async def settle(self) -> None:  # every worker known from the start
        return None

    def views(self, now: float) -> list[WorkerView]:
        return self._views


class Index:
    def __init__(self, gpu: dict[str, int], total: dict[str, int]) -> None:
        self.found = PrefixMatches(gpu, total)

    async def lookup(self, hashes: Any, tenant: str = "", lora: str = "", token_ids: Any = None) -> PrefixMatches:
        return self.found


def worker(wid: str, kvsync: bool = True, draining: bool = False) -> WorkerView:
    addr = f"127.0.0.1:{9000 + ord(wid[0])}" if kvsync else ""
    return WorkerView(
        wid, kvsync_address=addr, tier_region="cpu", tier_shm_name=f"shm-{wid}", draining=draining, transfer=COSTS
    )


class Logged(Placement):
    """A placement whose profile keeps its last decision: the terms the request's log shows (`Decision.prefix`)."""

    decision: Decision

    @property
    def plan(self) -> dict[str, object]:
        return self.decision.prefix


def placement(views: list[WorkerView], gpu: dict[str, int], total: dict[str, int], margin: float = 2.0) -> Logged:
    pool, index = cast(WorkerPool, Pool(views)), cast(IndexReplica, Index(gpu, total))
    profile = Profile.default(seed=1)
    p = Logged(profile, pool, index, InflightTracker(), BS, "tiny", pull_margin=margin)
    decide = profile.decide

    def keep(q: RoutingQuery, vs: Sequence[WorkerView]) -> Decision:
        p.decision = decide(q, vs)
        return p.decision

    profile.decide = keep  # type: ignore[method-assign,assignment]
    return p


def hints(outcome: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_router_kv_pull_hints_total", {"outcome": outcome}) or 0.0


async def test_a_prefix_only_in_a_worker_s_cpu_tier_is_a_tier_load_there() -> None:
    p = placement([worker("a"), worker("b")], gpu={"a": 0}, total={"a": N})
    routed = await p.route("r1", PROMPT, "", set())
    plan = p.plan
    assert routed.worker_id == "a"
    assert (plan["gpu_blocks"], plan["load_blocks"], plan["pull_blocks"], plan["source"]) == (0, N, 0, "")
    assert plan["load_s"] == pytest.approx(N * COSTS.block_load_s, rel=1e-6)
    assert (plan["recompute_tokens"], plan["recompute_s"], plan["pull_s"], plan["hint"]) == (0, 0.0, 0.0, "")
    assert routed.overlap == N * BS and routed.pull is None
    assert p.decision.to_log()["prefix"] == plan  # logged with the decision


async def test_a_drained_holder_s_prefix_is_pulled_with_the_plan_s_hint() -> None:
    p = placement([worker("a", draining=True), worker("b")], gpu={"a": N}, total={"a": N})
    sent = hints("sent")
    routed = await p.route("r1", PROMPT, "", set())
    plan, hint = p.plan, routed.pull
    assert routed.worker_id == "b" and hint is not None
    assert (plan["gpu_blocks"], plan["load_blocks"], plan["pull_blocks"], plan["source"]) == (0, 0, N, "a")
    assert plan["pull_s"] == pytest.approx(pull_seconds(N, COSTS), rel=1e-6)
    assert (plan["recompute_s"], plan["hint"], plan["hint_blocks"]) == (0.0, "sent", N - 1)
    assert hint.source_worker_id == "a" and hint.source_address == "127.0.0.1:9097"
    assert (hint.region, hint.shm_name) == ("cpu", "shm-a")
    assert hint.num_blocks == N - 1  # the block holding the last prompt token is always computed
    assert hint.expires_unix_ms > 0 and hints("sent") == sent + 1


async def test_two_requests_for_one_prefix_on_one_worker_pull_it_once() -> None:
    p = placement([worker("a", draining=True), worker("b")], gpu={"a": N}, total={"a": N})
    sent, joined = hints("sent"), hints("joined")
    first = (await p.route("r1", PROMPT, "", set())).pull
    routed = await p.route("r2", PROMPT, "", set())
    second, plan = routed.pull, p.plan
    assert routed.worker_id == "b" and first is not None and second is not None
    assert (plan["pull_blocks"], plan["load_blocks"], plan["hint"]) == (0, N - 1, "joined")  # as b's own tier
    assert (second.source_worker_id, second.num_blocks) == (first.source_worker_id, first.num_blocks)
    assert second == first  # the same pull: the worker joins it
    assert (hints("sent"), hints("joined")) == (sent + 1, joined + 1)


async def test_a_worker_serving_no_kv_sync_is_never_a_pull_source() -> None:
    p = placement([worker("a", kvsync=False, draining=True), worker("b")], gpu={"a": N}, total={"a": N})
    routed = await p.route("r1", PROMPT, "", set())
    assert routed.worker_id == "b" and routed.pull is None
    assert (p.plan["pull_blocks"], p.plan["recompute_tokens"], p.plan["hint"]) == (0, N * BS, "")


@pytest.mark.parametrize("margin", [0.0, 1e9])
async def test_no_pull_when_the_margin_forbids_it(margin: float) -> None:
    p = placement([worker("a", draining=True), worker("b")], gpu={"a": N}, total={"a": N}, margin=margin)
    assert (await p.route("r1", PROMPT, "", set())).pull is None and p.plan["pull_blocks"] == 0


async def test_the_margin_is_pull_seconds_against_recompute_seconds() -> None:
    ratio = N * BS * COSTS.prefill_s_per_token / pull_seconds(N, COSTS)
    for margin, pulls in ((ratio * 0.99, True), (ratio * 1.01, False)):
        p = placement([worker("a", draining=True), worker("b")], gpu={"a": N}, total={"a": N}, margin=margin)
        assert ((await p.route("r1", PROMPT, "", set())).pull is not None) is pulls


async def test_the_pull_reaches_the_worker_as_its_kv_pull_hint() -> None:
    p = placement([worker("a", draining=True), worker("b")], gpu={"a": N}, total={"a": N})
    pull = (await p.route("r1", PROMPT, "", set())).pull
    assert pull is not None
    msg = pull_to_proto(pull)  # where the worker request is built (services/router/attempt.py)
    assert (msg.source_worker_id, msg.region_shm_name, msg.num_blocks) == ("a", "shm-a", N - 1)
    assert pull_from_proto(msg) == pull  # and the worker reads back the router's decision, field for field
