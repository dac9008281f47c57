"""`kvmesh.bench.router_features`: what a feature adds is computed from the four paths' figures; the check
before a run refuses a path that dropped the feature; the bench's flags refuse bad values by name."""

from __future__ import annotations

import json

import pytest

from kvmesh.bench.router_features import (
    BENCH_SCHEMA,
    LOGPROBS,
    RESPONSE_FORMAT,
    Feature,
    FeatureCheckError,
    c1_rounds,
    check_tokens,
    feature_cost,
    features_from_flags,
    split_features,
)
from kvmesh.bench.router_service import main as bench_main
from kvmesh.v1 import common_pb2


def _figs(c1: float, cpu: float | None = None) -> dict[str, float]:
    return {"c1_p50_ms": c1, "c1_p99_ms": c1 * 2, "c8_rps": 100.0} | (
        {} if cpu is None else {"cpu_us_per_request": cpu}
    )


def test_feature_cost_is_the_overhead_difference_per_request_and_per_token() -> None:
    cost = feature_cost(_figs(5.0, 900.0), _figs(4.0), _figs(7.5, 1300.0), _figs(4.5), tokens=8)
    assert cost == {
        "plain_overhead_ms": 1.0,
        "feature_overhead_ms": 3.0,
        "extra_ms_per_request": 2.0,
        "extra_us_per_token": 250.0,
        "plain_cpu_us_per_request": 900.0,
        "feature_cpu_us_per_request": 1300.0,
        "extra_cpu_us_per_request": 400.0,
        "extra_cpu_us_per_token": 50.0,
    }


def test_a_router_path_without_its_cpu_figure_is_an_error_not_a_zero() -> None:
    with pytest.raises(KeyError, match="cpu_us_per_request"):
        feature_cost(_figs(5.0), _figs(4.0), _figs(7.5, 1.0), _figs(4.5), tokens=1)


def test_split_features_pairs_each_feature_with_the_plain_paths() -> None:
    lp, rf = features_from_flags(5, "json")
    got = {
        "kvmesh": _figs(5.0, 900.0),
        "direct": _figs(4.0),
        "kvmesh+logprobs": _figs(6.0, 1000.0),
        "direct+logprobs": _figs(4.0),
        "kvmesh+response_format": _figs(5.0, 950.0),
        "direct+response_format": _figs(4.5),
    }
    out = split_features(got, "kvmesh", [lp, rf], tokens=2)
    assert out["logprobs"]["kvmesh"] is got["kvmesh+logprobs"] and out["logprobs"]["direct"] is got["direct+logprobs"]
    assert out["logprobs"]["extra_ms_per_request"] == 1.0 and out["logprobs"]["extra_cpu_us_per_token"] == 50.0
    assert out["response_format"]["extra_ms_per_request"] == -0.5  # noise can be negative: reported as measured


def test_features_set_their_field_and_leave_the_plain_request_alone() -> None:
    assert features_from_flags(None, "") == []
    assert c1_rounds([], 200) == 4  # the plain bench as ever; with a feature, blocks of 10 requests per path
    assert c1_rounds(features_from_flags(2, ""), 200) == 20 and c1_rounds(features_from_flags(2, ""), 4) == 1
    lp, js = features_from_flags(0, "json_schema")
    assert (lp.name, lp.top_logprobs, js.name, js.grammar, lp.grammar) == (LOGPROBS, 0, RESPONSE_FORMAT, True, False)
    plain = common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)
    with_lp = lp.grpc_sampling(plain)
    assert with_lp.HasField("logprobs") and with_lp.logprobs == 0 and with_lp.max_tokens == 4
    assert json.loads(js.grpc_sampling(plain).structured_output.json_schema) == BENCH_SCHEMA
    assert Feature(RESPONSE_FORMAT, response_format="json").grpc_sampling(plain).structured_output.json_object
    assert not plain.HasField("logprobs") and not plain.HasField("structured_output")
    body = {"prompt": "x", "max_tokens": 4}
    assert lp.http_body(body) == {**body, "logprobs": 0}
    assert js.http_body(body)["response_format"]["json_schema"]["schema"] == BENCH_SCHEMA
    assert Feature(RESPONSE_FORMAT, response_format="json").http_body(body)["response_format"] == {
        "type": "json_object"
    }
    assert body == {"prompt": "x", "max_tokens": 4}


def test_check_tokens_refuses_a_path_that_dropped_or_cut_the_feature() -> None:
    lp = Feature(LOGPROBS, top_logprobs=3)
    check_tokens("router", 4, [], None, 4)
    check_tokens("router+logprobs", 4, [3, 3, 3, 3], lp, 4)
    check_tokens("kvmesh+logprobs", 4, [3, 1, 2, 3], lp, 4, merged=True)  # texts that decode alike share a key
    with pytest.raises(FeatureCheckError, match="3 tokens came back, not max_tokens=4"):
        check_tokens("router", 3, [], None, 4)
    with pytest.raises(FeatureCheckError, match="log-probabilities for 0 of 4 tokens"):
        check_tokens("router+logprobs", 4, [], lp, 4)  # the router dropped them
    with pytest.raises(FeatureCheckError, match=r"alternatives per token \[3, 3, 2, 3\], asked for 3"):
        check_tokens("router+logprobs", 4, [3, 3, 2, 3], lp, 4)
    with pytest.raises(FeatureCheckError, match="asked for 3"):
        check_tokens("kvmesh+logprobs", 4, [3, 0, 3, 3], lp, 4, merged=True)
    with pytest.raises(FeatureCheckError, match="came back unasked"):
        check_tokens("router", 4, [3, 3, 3, 3], None, 4)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--logprobs", "21"], "--logprobs must be in [0, 20], got 21"),
        (["--logprobs", "-1"], "--logprobs must be in [0, 20], got -1"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
        (["--response-format", "yaml"], "invalid choice: 'yaml'"),
        (["--api", "http", "--logprobs", "2", "--compare", "sglang"], "not with --compare or --client-processes"),
        (["--api", "http", "--response-format", "json", "--client-processes", "2"], "not with --compare"),
    ],
)
def test_bad_feature_flags_are_refused_by_name(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_main(flags)  # refused before any process starts
    assert exc.value.code == 2 and message in capsys.readouterr().err
