"""Routing's configuration and admission at their edges: the smallest valid settings accepted, the first
invalid one refused with its message, the default long-prompt boundary, admission's errors naming the request
and the queue, and a profile's or a rebalance's errors naming the part that is wrong."""

from __future__ import annotations

import pytest

from kvmesh.core.errors import InvalidArgument, ResourceExhausted
from kvmesh.routing.admission import Admission, QueueLimits
from kvmesh.routing.filters import PoolFilter
from kvmesh.routing.pickers import MinCostPicker
from kvmesh.routing.profile import Profile
from kvmesh.routing.scorers.cost import CostScorer
from kvmesh.routing.types import RoutingQuery, WorkerView

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("concurrency", "queue"), [(0, 0), (1, -1)])
def test_queue_limits_need_one_slot_and_a_queue_of_at_least_zero(concurrency: int, queue: int) -> None:
    with pytest.raises(InvalidArgument) as e:
        QueueLimits(concurrency, queue)
    assert e.value.field == "queue" and e.value.message == "queue: max_concurrency must be >= 1 and max_queue >= 0"


def test_admission_names_a_request_admitted_twice_and_a_full_queue() -> None:
    adm = Admission(QueueLimits(1, 0), QueueLimits(1, 0))
    assert adm.admit("r1", 10, now=0.0)
    with pytest.raises(InvalidArgument) as e:
        adm.admit("r1", 10, now=0.0)
    assert e.value.field == "request_id" and e.value.message == "request_id: 'r1' is already admitted"
    with pytest.raises(ResourceExhausted) as full:
        adm.admit("r2", 10, now=0.0)
    assert full.value.message == "short queue full (0 waiting, 1 running)"


def test_a_prompt_of_2048_tokens_is_short_by_default_and_2049_long() -> None:
    adm = Admission(QueueLimits(1, 0), QueueLimits(1, 0))
    assert (adm.class_of(2048), adm.class_of(2049)) == ("short", "long")


def test_the_pool_filter_takes_a_boundary_of_one_token() -> None:
    assert PoolFilter(1).long_prompt_tokens == 1
    with pytest.raises(ValueError, match=r"^long_prompt_tokens must be >= 1$"):
        PoolFilter(0)


def test_the_min_cost_picker_takes_one_choice_and_names_its_tie_breaks() -> None:
    MinCostPicker(choices=1)
    with pytest.raises(ValueError, match=r"^choices must be >= 1$"):
        MinCostPicker(choices=0)
    with pytest.raises(ValueError, match=r"^tie_break must be random or hash$"):
        MinCostPicker(tie_break="first")


@pytest.mark.parametrize(
    ("spec", "field", "message"),
    [
        ([1], "profile", "a profile is a mapping"),
        ({"x": 1}, "profile", "unknown keys ['x']"),
        ({"scorers": [{"weight": 1}]}, "scorer", "each scorer needs a 'type': {'weight': 1}"),
        (
            {"scorers": [{"type": "cost", "params": {"prefill_slots": -1}}]},
            "scorer",
            "cost: prefill_slots must be >= 0",
        ),
        ({"scorers": [{"type": "cost", "weight": -1}]}, "weight", "scorer weights must be >= 0"),
    ],
    ids=["not-a-mapping", "unknown-key", "no-type", "bad-parameter", "negative-weight"],
)
def test_a_bad_profile_is_refused_naming_the_part(spec: object, field: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        Profile.from_dict(spec)  # type: ignore[arg-type]
    assert e.value.field == field and e.value.message == f"{field}: {message}"


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"prefill_weight": 0.7}, "prefill_weight", "give both prefill_weight and decode_weight"),
        ({"scorer_weights": {"missing": 1.0}}, "scorer_weights", "no scorer named 'missing'"),
        ({"scorer_weights": {"cost": -1.0}}, "scorer_weights", "weights must be >= 0"),
    ],
    ids=["prefill-alone", "unknown-scorer", "negative"],
)
def test_a_bad_rebalance_is_refused_naming_the_argument(kwargs: dict[str, object], field: str, message: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        Profile.default().set_weights(**kwargs)  # type: ignore[arg-type]
    assert e.value.field == field and e.value.message == f"{field}: {message}"


def test_the_weights_report_the_cost_scorers_decode_weight() -> None:
    p = Profile.default()
    p.set_weights(prefill_weight=0.25, decode_weight=0.75)
    weights = p.weights()
    assert weights["cost.prefill_weight"] == pytest.approx(0.25)
    assert weights["cost.decode_weight"] == pytest.approx(0.75)


def test_a_decisions_log_line_carries_every_field() -> None:
    req = RoutingQuery("r1", prompt_tokens=64, block_size=16, matches={"a": 2})
    d = Profile.default(seed=0).decide(req, [WorkerView("a"), WorkerView("b")])
    line = d.to_log()
    assert set(line) == {"request_id", "worker", "picker", "rejected_by", "removed", "chosen", "scores", "prefix"}
    assert (line["request_id"], line["worker"]) == ("r1", d.worker_id)
    assert line["removed"] == dict(d.removed) and line["prefix"] == dict(d.prefix)


@pytest.mark.parametrize(("prefill", "decode"), [(-0.1, 1.0), (1.0, -0.1), (0.0, 0.0)])
def test_cost_weights_must_be_non_negative_and_not_both_zero(prefill: float, decode: float) -> None:
    with pytest.raises(ValueError, match=r"^weights must be >= 0 and not both 0$"):
        CostScorer().set_weights(prefill, decode)
    CostScorer().set_weights(0.0, 1.0)
