"""The chaos campaign's schedule: replayable from its seed, every kind in a short run, the overlap rule kept."""

from __future__ import annotations

import pytest

from kvmesh.bench.chaos_schedule import (
    KINDS,
    LINK_KINDS,
    MAX_ACTIVE,
    PROCESS_KINDS,
    TERM_HOLD_S,
    WORKER_ONLY_KINDS,
    WORKER_RESTART_S,
    Fault,
    allowed,
    counts,
    make_schedule,
    process_targets,
)


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    assert make_schedule(1, 300) == make_schedule(1, 300)
    assert [f.line() for f in make_schedule(1, 300)] == [f.line() for f in make_schedule(1, 300)]
    assert make_schedule(1, 300) != make_schedule(2, 300)


@pytest.mark.parametrize("seed", range(20))
def test_a_short_run_has_every_kind_inside_its_window(seed: int) -> None:
    faults = make_schedule(seed, 90, warmup_s=5, settle_s=15, mean_gap_s=3)
    assert all(n >= 1 for n in counts(faults).values()), counts(faults)
    assert all(f.t >= 5 and f.end <= 75 for f in faults)
    assert [f.t for f in faults] == sorted(f.t for f in faults)


@pytest.mark.parametrize("seed", range(20))
def test_the_overlap_rule_holds_at_every_instant(seed: int) -> None:
    faults = make_schedule(seed, 600, mean_gap_s=2)  # dense: the rule has to push faults back
    for f in faults:
        active = [g for g in faults if g.t <= f.t < g.end]
        assert len(active) <= MAX_ACTIVE, [g.line() for g in active]
        assert sum(g.kind in PROCESS_KINDS for g in active) <= 1, [g.line() for g in active]
        assert sum(g.kind in LINK_KINDS for g in active) <= 1, [g.line() for g in active]


def test_targets_name_the_suites_processes_zones_and_workers() -> None:
    procs = set(process_targets(("a", "b"), 2))
    services = ("router", "cache-manager", "failover", "planner", "worker-0", "worker-1")
    assert procs == {f"{z}/{s}" for z in "ab" for s in services} | {"a/redis"}  # the first zone's store
    workers = {"a/worker-0", "a/worker-1", "b/worker-0", "b/worker-1"}
    schedule = make_schedule(3, 600)
    for f in schedule:
        if f.kind in WORKER_ONLY_KINDS:
            assert f.target in workers, f.line()
        elif f.kind in PROCESS_KINDS:
            assert f.target in procs
        elif f.kind in ("rogue_drain", "checkpoint_full"):
            assert f.target in ("a", "b")
    delays = [f.params["delay_ms"] for f in schedule if f.kind == "link_delay"]
    assert delays and all(20 <= d <= 200 for d in delays)
    caps = [f.params["bytes_per_s"] for f in schedule if f.kind == "link_cap"]
    assert caps and all(64_000 <= c <= 4_000_000 for c in caps)
    assert {f.params["version"] for f in schedule if f.kind == "version_skew"} == {"chaos-skew"}
    assert {f.params["ttl_ms"] for f in schedule if f.kind == "lease_expire"} == {500}
    assert all(f.duration_s * 1000 > 500 for f in schedule if f.kind == "lease_expire")  # outlives its lease
    assert set(WORKER_ONLY_KINDS) >= {"version_skew", "oom_kill", "pull_peer_kill", "pool_full", "tier_corrupt"}
    hit = {f.target for seed in range(10) for f in make_schedule(seed, 600) if f.kind in PROCESS_KINDS}
    assert hit >= {"a/redis", "a/planner", "b/planner"}


def test_a_fault_that_restarts_a_worker_holds_the_rule_through_its_restarts() -> None:
    assert Fault(10, "version_skew", "a/worker-0", 4).end == 10 + 4 + 2 * WORKER_RESTART_S
    assert Fault(10, "oom_kill", "a/worker-0", 2).end == 10 + 2 + WORKER_RESTART_S
    assert Fault(10, "pull_peer_kill", "a/worker-0", 2).end == 10 + 2 + WORKER_RESTART_S
    assert Fault(10, "term", "a/router", 0).end == 10 + TERM_HOLD_S
    assert Fault(10, "link_cap", "link", 5).end == 15


def test_allowed_refuses_a_second_process_or_link_fault_and_a_third_fault() -> None:
    kill = Fault(0, "kill", "a/router", 3)
    cut = Fault(0, "link_cut", "link", 3)
    assert not allowed([kill], "stop")
    assert not allowed([cut], "link_flap")
    assert allowed([kill], "link_cut") and allowed([cut], "burst")
    assert not allowed([kill, cut], "burst")


def test_a_window_too_short_for_every_kind_is_refused_naming_what_is_left_out() -> None:
    with pytest.raises(ValueError, match="too short for one fault of each kind") as e:
        make_schedule(1, 40, warmup_s=5, settle_s=20, mean_gap_s=6)
    assert any(k in str(e.value) for k in KINDS)


@pytest.mark.parametrize("seed", range(5))
def test_a_long_run_injects_every_kind_about_as_often(seed: int) -> None:
    """Kinds come in rounds of one each: a 30-minute run's counts differ by one at most, and each reaches 10."""
    n = counts(make_schedule(seed, 1800))
    assert max(n.values()) - min(n.values()) <= 1, n
    assert min(n.values()) >= 10, n
