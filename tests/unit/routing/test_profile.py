"""Profiles from YAML: construction, validation, decisions, and run-time rebalancing."""

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.routing import Profile, RoutingQuery, WorkerView
from kvmesh.routing.types import CircuitState

pytestmark = pytest.mark.unit


def test_default_profile_shape() -> None:
    p = Profile.default(seed=1)
    assert [f.name for f in p.filters] == ["healthy", "not-draining", "circuit-closed", "kv-headroom", "pool"]
    assert [s.name for s, _ in p.scorers] == ["cost", "session-affinity"]
    assert p.picker.name == "min-cost"
    assert p.weights()["cost.prefill_weight"] == pytest.approx(0.9)


def test_yaml_names_params_and_errors() -> None:
    p = Profile.from_yaml(
        """
name: mine
filters: [healthy]
scorers:
  - {type: prefill-cost, weight: 2}
  - {type: decode-load, name: dl, weight: 1}
picker: {type: min-cost, params: {epsilon: 0}}
""",
        seed=0,
    )
    assert p.name == "mine"
    assert p.weights() == {"prefill-cost": 2.0, "dl": 1.0}
    for bad in (
        "filters: [nope]",
        "scorers: [{type: cost, params: {prefill_weight: -1}}]",
        "picker: {type: min-cost, params: {bogus: 1}}",
        "extra: 1",
        "a: [",
        "- just a list",
        "scorers: [{type: cost}, {type: cost}]",
    ):
        with pytest.raises(InvalidArgument):
            Profile.from_yaml(bad)


def test_rebalance_changes_the_next_decision() -> None:
    # hot: whole prompt cached but 8192 decode tokens; cold: nothing cached, idle. S = 8192.
    #   alpha = 0.7: hot = 0.3·1 = 0.30, cold = 0.7·0.5 = 0.35 -> hot
    #   alpha = 0.3: hot = 0.70,         cold = 0.3·0.5 = 0.15 -> cold
    hot = WorkerView("hot", decode_tokens_active=8192)
    cold = WorkerView("cold")
    req = RoutingQuery("r", prompt_tokens=4096, block_size=16, matches={"hot": 256})
    p = Profile.default(seed=0)
    p.set_weights(prefill_weight=0.7, decode_weight=0.3)
    assert {p.decide(req, [hot, cold]).worker_id for _ in range(20)} == {"hot"}
    p.set_weights(prefill_weight=0.3, decode_weight=0.7)
    d = p.decide(req, [hot, cold])
    assert d.worker_id == "cold"
    assert d.chosen_terms()["cost"] == pytest.approx(0.15)
    assert d.scores() == pytest.approx({"hot": 0.7, "cold": 0.15})


def test_set_weights_validation_is_all_or_nothing() -> None:
    p = Profile.default()
    with pytest.raises(InvalidArgument):
        p.set_weights(prefill_weight=0.7)
    with pytest.raises(InvalidArgument):
        p.set_weights(0.7, 0.3, scorer_weights={"missing": 1.0})
    with pytest.raises(InvalidArgument):
        p.set_weights(0.0, 0.0)
    assert p.weights()["cost.prefill_weight"] == pytest.approx(0.9)
    p.set_weights(scorer_weights={"session-affinity": 0.5})
    assert p.weights()["session-affinity"] == 0.5
    with pytest.raises(InvalidArgument):
        Profile.baseline("random").set_weights(0.7, 0.3)


def test_rejected_by_names_the_emptying_filter_and_removed_counts() -> None:
    p = Profile.default(seed=0)
    ws = [WorkerView("a", healthy=False), WorkerView("b", draining=True)]
    d = p.decide(RoutingQuery("r", 10), ws)
    assert d.worker_id is None and d.rejected_by == "not-draining"
    assert d.removed == {"healthy": 1, "not-draining": 1}
    ws = [WorkerView("a", circuit=CircuitState.OPEN), WorkerView("b")]
    assert p.decide(RoutingQuery("r", 10), ws).removed == {"circuit-closed": 1}
    assert p.decide(RoutingQuery("r", 10), []).rejected_by == "no-workers"
    full = [WorkerView("f", kv_usage=0.99, kv_blocks_total=100)]
    assert p.decide(RoutingQuery("r", 10), full).rejected_by == "kv-headroom"


def test_baselines_route_and_log() -> None:
    ws = [WorkerView(f"w{i}") for i in range(3)]
    rr = Profile.baseline("round-robin")
    assert [rr.decide(RoutingQuery(str(i), 5), ws).worker_id for i in range(4)] == ["w0", "w1", "w2", "w0"]
    d = Profile.baseline("least-loaded", seed=1).decide(RoutingQuery("x", 5), ws)
    assert d.to_log()["picker"] == "least-loaded"
    with pytest.raises(InvalidArgument):
        Profile.baseline("min-cost")


def test_session_affinity_with_dominant_weight_sticks() -> None:
    p = Profile.default(seed=3)
    p.set_weights(scorer_weights={"session-affinity": 10.0})
    ws = [WorkerView(f"w{i}") for i in range(8)]
    chosen = {p.decide(RoutingQuery(f"r{i}", 100, session_id="chat-1"), ws).worker_id for i in range(30)}
    assert len(chosen) == 1
