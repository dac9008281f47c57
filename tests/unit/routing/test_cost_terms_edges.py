"""The data-plane pricer, the prefill/decode decision and the cost scorer at their edges: each term of their
module docstrings computed to the exact figure (recompute time, handoff blocks ⌊(P − 1)/b⌋, remote wait), the
zero-block and zero-rate boundaries, the second pull source, the decode-full threshold and the reason that
names a missing pool. Then the rest of routing's contracts its other tests left open: a seeded picker repeats
itself and a plugin's own seed wins, exact ties are broken at random, the ring's default and clockwise walk, a
report taken at the assignment instant, the retry hint's service time, a rejected request's reason. Each test
fails if a term, a comparison or an argument changes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from kvmesh.core.errors import InvalidArgument, ResourceExhausted
from kvmesh.core.handoff import WorkerRole
from kvmesh.core.kvevents import LoadReport
from kvmesh.routing.admission import Admission, QueueLimits
from kvmesh.routing.attempts import Action, Attempts, Failed, Failure, Limits
from kvmesh.routing.attempts import decide as decide_attempt
from kvmesh.routing.dataplane import PrefixPlan, plan_prefix, pull_pays, pull_seconds, sources_of, top_sources
from kvmesh.routing.disagg import PdParams, decide, link_factor
from kvmesh.routing.inflight import InflightTracker
from kvmesh.routing.pickers import LeastLoadedPicker, MinCostPicker, RandomPicker
from kvmesh.routing.profile import Profile
from kvmesh.routing.ring import HashRing
from kvmesh.routing.scorers.cost import CostScorer
from kvmesh.routing.scorers.prefill_cost import PrefillCostScorer
from kvmesh.routing.types import RoutingQuery, TransferCosts, WorkerView

pytestmark = pytest.mark.unit
BS = 16
COSTS = TransferCosts(prefill_s_per_token=1e-3, block_load_s=2e-3, block_pull_s=3e-3, pull_rtt_s=5e-3)


def test_without_a_data_plane_the_plan_recomputes_the_prompt_less_the_gpu_hit() -> None:
    q = RoutingQuery("r", 100, matches={"w": 2}, block_size=BS)
    p = plan_prefix(q, WorkerView("w"))
    assert (p.gpu_blocks, p.recompute_tokens) == (2, 100 - 2 * BS)


def test_the_plan_prices_its_recompute_at_the_workers_prefill_rate() -> None:
    q = RoutingQuery("r", 100, matches={"w": 1}, block_size=BS, tier_matches={"w": 1})
    p = plan_prefix(q, WorkerView("w", transfer=COSTS))
    assert p.recompute_tokens == 100 - BS
    assert p.recompute_s == pytest.approx((100 - BS) * COSTS.prefill_s_per_token)
    assert p.time_s == pytest.approx(p.recompute_s)


def test_no_blocks_cost_no_pull_time_and_never_pay() -> None:
    assert pull_seconds(0, COSTS) == 0.0
    assert pull_seconds(1, COSTS) == pytest.approx(COSTS.pull_rtt_s + COSTS.block_pull_s + COSTS.block_load_s)
    assert pull_pays(0, BS, COSTS, margin=0.0) is False
    assert pull_pays(-1, BS, COSTS, margin=0.0) is False


def test_a_third_source_shorter_than_the_first_replaces_a_shorter_second() -> None:
    assert top_sources({"a": 5, "b": 3, "c": 4}) == [("a", 5), ("c", 4)]
    assert top_sources({"a": 5, "b": 4, "c": 3}) == [("a", 5), ("b", 4)]


def test_a_zero_prefill_rate_reports_the_recompute_tokens_not_a_division() -> None:
    free = TransferCosts(prefill_s_per_token=0.0, block_load_s=1.0, block_pull_s=1.0, pull_rtt_s=1.0)
    assert PrefixPlan("w", 0, recompute_tokens=7, load_s=2.0).prefill_tokens(free) == 7.0
    assert PrefixPlan("w", 0, recompute_tokens=7, load_s=2.0).prefill_tokens(None) == 7.0


def pd_workers(decode_kv_usage: float = 0.0) -> list[WorkerView]:
    return [
        WorkerView("p", role=WorkerRole.PREFILL, transfer=COSTS),
        WorkerView("d", role=WorkerRole.DECODE, transfer=COSTS, kv_usage=decode_kv_usage),
    ]


def test_the_reason_names_the_missing_pool() -> None:
    q = RoutingQuery("r", 1000, block_size=BS)
    no_decode = decide(q, [WorkerView("p", role=WorkerRole.PREFILL)])
    assert (no_decode.disaggregate, no_decode.reason) == (False, "no-decode-pool")
    no_prefill = decide(q, [WorkerView("d", role=WorkerRole.DECODE)])
    assert (no_prefill.disaggregate, no_prefill.reason) == (False, "no-prefill-pool")


def test_the_terms_are_those_of_the_docstring_with_the_workers_own_prefill_rate() -> None:
    prompt = 2 * BS + 1  # ⌊(P − 1)/b⌋ = 2 blocks handed over; ⌊(P − 2)/b⌋ would be 1
    q = RoutingQuery("r", prompt, block_size=BS)
    ws = pd_workers()
    ws[0].prefill_tokens_queued = 10
    dec = decide(q, ws, PdParams(min_uncached_tokens=1))
    s = COSTS.prefill_s_per_token  # the worker's transfer figure, not PdParams' 1.43e-4
    handoff = COSTS.pull_rtt_s + 2 * COSTS.block_pull_s * 1.0
    assert (dec.disaggregate, dec.prefill_worker, dec.decode_worker) == (True, "p", "d")
    assert dec.terms["prefill_queue_s"] == pytest.approx(10 * s)
    assert dec.terms["handoff_s"] == pytest.approx(handoff)
    assert dec.terms["remote_s"] == pytest.approx(10 * s + prompt * s + handoff)
    assert dec.terms["local_s"] == pytest.approx(prompt * s)


def test_a_busy_prefill_pool_names_both_workers_it_weighed() -> None:
    ws = pd_workers()
    ws[0].prefill_tokens_queued = 10_000  # 10 s of queue, past the 2 s limit; in place is sooner
    dec = decide(RoutingQuery("r", 1000, block_size=BS), ws)
    assert (dec.disaggregate, dec.reason, dec.prefill_worker, dec.decode_worker) == (False, "prefill-busy", "p", "d")


@pytest.mark.parametrize(("usage", "full"), [(0.79, False), (0.8, True)])
def test_a_decode_worker_at_the_kv_limit_is_full(usage: float, full: bool) -> None:
    dec = decide(
        RoutingQuery("r", 1000, block_size=BS), pd_workers(decode_kv_usage=usage), PdParams(max_decode_kv_usage=0.8)
    )
    assert dec.disaggregate is not full
    assert dec.reason == ("decode-full" if full else "disaggregate")


def test_a_worker_without_a_zone_is_not_in_another_zone() -> None:
    params = PdParams()
    assert link_factor(WorkerView("a"), WorkerView("b", zone="z1"), params) == params.same_zone
    assert link_factor(WorkerView("a", zone="z1"), WorkerView("b"), params) == params.same_zone
    assert link_factor(WorkerView("a", zone="z1"), WorkerView("b", zone="z2"), params) == params.other_zone


def test_running_requests_cost_nothing_by_default() -> None:
    idle, busy = WorkerView("idle"), WorkerView("busy", running=8, inflight_requests=8)
    q = RoutingQuery("r", 4000, block_size=BS)
    a, b = CostScorer().score(q, [idle, busy], [idle, busy])
    assert a == b
    a, b = CostScorer(interference_weight=1.0).score(q, [idle, busy], [idle, busy])
    assert a < b


def test_with_a_data_plane_the_cost_prices_a_peer_pull_from_the_plan() -> None:
    prompt = 64 * BS
    q = RoutingQuery(
        "r", prompt, matches={"a": 0, "b": 0}, block_size=BS, tier_matches={"a": 64, "b": 0}, peer_pulls=True,
        pull_margin=1.0,
    )  # fmt: skip
    a, b = WorkerView("a", transfer=COSTS), WorkerView("b", transfer=COSTS)
    plan_b = plan_prefix(q, b, sources_of(q))
    assert plan_b.pull_blocks == 64 and plan_b.source == "a"
    n_a = 64 * COSTS.block_load_s / COSTS.prefill_s_per_token
    n_b = plan_b.prefill_tokens(COSTS)
    scale = max(n_a, n_b, 1.0)
    assert CostScorer().score(q, [a, b], [a, b]) == pytest.approx([0.5 * n_a / scale, 0.5 * n_b / scale])
    assert n_b < prompt  # the pull is priced below recomputing the prompt


def test_a_load_report_is_copied_field_by_field_into_the_view() -> None:
    view = WorkerView("w")
    view.apply_report(LoadReport("w", running=3, waiting=2, kv_usage=0.5, prefill_tokens_queued=40, timestamp=9.0))
    assert (view.running, view.waiting, view.kv_usage, view.prefill_tokens_queued, view.report_ts) == (
        3,
        2,
        0.5,
        40,
        9.0,
    )


def test_an_attempts_token_count_sums_its_steps() -> None:
    att = Attempts("r", Limits(max_retries=1, max_migrations=1, max_tokens=100))
    att.next_attempt(0)
    att.add([1, 2])
    att.add([3])
    assert att.n_attempt == 3


@pytest.mark.parametrize("make", [lambda: RandomPicker(seed=7), lambda: MinCostPicker(epsilon=1.0, seed=7)])
def test_a_seeded_picker_repeats_its_choices(make: Callable[[], RandomPicker | MinCostPicker]) -> None:
    workers = [WorkerView(f"w{i}") for i in range(8)]
    q = RoutingQuery("r", 10)
    first, second = make(), make()
    picks = [first.pick(q, workers, [0.0] * 8) for _ in range(32)]
    assert picks == [second.pick(q, workers, [0.0] * 8) for _ in range(32)]
    assert len(set(picks)) > 1  # a real draw, not a constant


def test_a_single_scorer_profile_reports_its_term_as_the_totals() -> None:
    busy, idle = WorkerView("busy", prefill_tokens_queued=100), WorkerView("idle")
    d = Profile([], [(CostScorer(), 1.0)], MinCostPicker(epsilon=0.0, seed=1)).decide(
        RoutingQuery("r", 10), [busy, idle]
    )
    assert d.worker_id == "idle"
    assert list(d.terms["cost"]) == list(d.totals) and d.totals[0] > d.totals[1]


def test_the_retry_hint_follows_the_slot_holding_time_not_the_clock() -> None:
    adm = Admission(QueueLimits(1, 0), QueueLimits(1, 0), min_retry_s=0.0, max_retry_s=1e9, initial_service_s=1.0)
    assert adm.admit("r1", 10, now=100.0)
    adm.release("r1", now=110.0)  # held 10 s: ewma = 0.8 · 1 + 0.2 · 10
    assert adm.admit("r2", 10, now=110.0)
    with pytest.raises(ResourceExhausted) as full:
        adm.admit("r3", 10, now=110.0)
    assert full.value.retry_after_s == pytest.approx(0.8 * 1.0 + 0.2 * 10.0)


def test_a_request_the_worker_rejects_fails_with_the_workers_detail_as_its_reason() -> None:
    lim = Limits(max_retries=1, max_migrations=1, max_tokens=100)
    d = decide_attempt("r", Failed(Failure.CLIENT_ERROR, "INVALID_ARGUMENT: top_k", "top_k"), 0, 0, 0, lim)
    assert d.action is Action.FAIL and d.reason == "INVALID_ARGUMENT: top_k"
    assert isinstance(d.error, InvalidArgument) and d.error.field == "top_k"


def test_a_restricted_lookup_walks_clockwise_to_the_ring_of_the_allowed_workers() -> None:
    workers = [f"w{i}" for i in range(6)]
    full, allowed = HashRing(workers), {"w1", "w4"}
    only = HashRing(sorted(allowed))
    keys = [f"k{i}" for i in range(200)]
    assert [full.lookup(k, allowed) for k in keys] == [only.lookup(k) for k in keys]


def test_rebalancing_a_profile_with_only_the_cost_scorer_sets_its_alpha() -> None:
    profile = Profile([], [(CostScorer(), 1.0)], MinCostPicker(seed=1))
    profile.set_weights(prefill_weight=0.3, decode_weight=0.7)
    assert profile.weights()["cost.prefill_weight"] == pytest.approx(0.3)


def test_a_pickers_own_seed_wins_over_the_profiles() -> None:
    spec = {"scorers": [{"type": "cost"}], "picker": {"type": "random", "params": {"seed": 3}}}
    picker = Profile.from_dict(spec, seed=99).picker
    workers = [WorkerView(f"w{i}") for i in range(8)]
    q, own, zeros = RoutingQuery("r", 10), RandomPicker(seed=3), [0.0] * 8
    assert [picker.pick(q, workers, zeros) for _ in range(32)] == [own.pick(q, workers, zeros) for _ in range(32)]


class ShortScorer:
    """A broken plugin: one score fewer than candidates."""

    name = "short"

    def score(
        self, req: RoutingQuery, candidates: Sequence[WorkerView], all_workers: Sequence[WorkerView]
    ) -> list[float]:
        return [1.0] * (len(candidates) - 1)


def test_a_scorer_that_misses_a_candidate_is_an_error_not_a_dropped_worker() -> None:
    profile = Profile([], [(CostScorer(), 1.0), (ShortScorer(), 1.0)], MinCostPicker(seed=1))
    with pytest.raises(ValueError):
        profile.decide(RoutingQuery("r", 10), [WorkerView("a"), WorkerView("b")])


def test_the_default_ring_has_128_points_per_worker() -> None:
    # Routers of two versions side by side (a rolling upgrade) must map keys alike: the default is part of that.
    workers = ["a", "b", "c"]
    default, explicit = HashRing(workers), HashRing(workers, vnodes=128)
    keys = [f"k{i}" for i in range(2000)]
    assert [default.lookup(k) for k in keys] == [explicit.lookup(k) for k in keys]


def test_least_loaded_breaks_exact_ties_at_random() -> None:
    picker, workers = LeastLoadedPicker(seed=5), [WorkerView(f"w{i}") for i in range(4)]
    picks = {picker.pick(RoutingQuery("r", 10), workers, [0.0] * 4) for _ in range(32)}
    assert len(picks) > 1
    for i in (0, 1, 3):
        workers[i].running = 1  # w2 alone least loaded: always it
    assert {picker.pick(RoutingQuery("r", 10), workers, [0.0] * 4) for _ in range(8)} == {2}


@pytest.mark.parametrize(("report_ts", "in_flight"), [(5.0, 0), (4.999, 100)])
def test_a_report_taken_at_the_assignment_instant_already_holds_the_request(report_ts: float, in_flight: int) -> None:
    tracker = InflightTracker()
    tracker.assign("r", "w", prefill_tokens=100, kv_tokens=100, block_size=BS, now=5.0)
    tracker.on_report("w", report_ts)
    view = WorkerView("w", prefill_tokens_queued=100)  # the report's queue: r's prefill, if it holds r
    tracker.apply([view])
    assert view.inflight_prefill_tokens == in_flight


def test_rebalancing_a_profile_with_only_the_prefill_cost_scorer_sets_its_weight() -> None:
    profile = Profile([], [(PrefillCostScorer(), 1.0)], MinCostPicker(seed=1))
    profile.set_weights(prefill_weight=0.3, decode_weight=0.7)
    assert profile.weights()["prefill-cost"] == pytest.approx(0.3)
