"""`python -m kvmesh.bench router --logprobs K --response-format json|json_schema --max-tokens N` over gRPC and
HTTP: one JSON line with the plain figures as ever and, per feature, its own router and direct figures and what
it adds (`kvmesh.bench.router_features`), each figure consistent with the paths it is computed from. The bench
checks one request per path before it measures (the tokens, the K alternatives, the grammar reaching a
stand-in worker through the router) and exits 1 otherwise, so a clean exit says the features were served."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = pytest.mark.integration

TINY = ["--workers", "1", "--prompt-tokens", "64", "--requests", "16", "--c1-requests", "4", "--concurrency", "2"]
FLAGS = ["--max-tokens", "4", "--logprobs", "3"]
RUNS = {
    "grpc": [*TINY, *FLAGS, "--response-format", "json"],
    "http": [*TINY, *FLAGS, "--response-format", "json_schema", "--api", "http", "--distinct-prompts", "2"],
}


@pytest.fixture(scope="module")
def runs() -> Iterator[dict[str, subprocess.Popen[str]]]:
    """Both benches started at once (each is mostly its processes' start-up): the tests read one each."""
    procs = {
        api: subprocess.Popen(
            [sys.executable, "-m", "kvmesh.bench", "router", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for api, args in RUNS.items()
    }
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)


def _result(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, out
    res = json.loads(lines[0])
    assert isinstance(res, dict)
    return res


def _sane(x: object) -> float:
    assert isinstance(x, int | float) and math.isfinite(x), x
    return float(x)


def _check_line(res: dict[str, Any], router: str, fmt: str) -> None:
    assert res["max_tokens"] == 4 and res["logprobs"] == 3 and res["response_format"] == fmt
    assert "grammar_stand_in" in res["grammar_workers"]  # the figures say which workers carried the grammar
    plain_r, plain_d = res[router]["64"], res["direct"]["64"]
    plain = _sane(plain_r["c1_p50_ms"]) - _sane(plain_d["c1_p50_ms"])
    assert set(res["features"]) == {"logprobs", "response_format"}
    for name, fig in res["features"].items():
        feat_r, feat_d = fig["64"][router], fig["64"]["direct"]
        for paths in (feat_r, feat_d):
            assert 0 < _sane(paths["c1_p50_ms"]) <= _sane(paths["c1_p99_ms"]) and _sane(paths["c2_rps"]) > 0
        cost = fig["64"]
        feature = _sane(feat_r["c1_p50_ms"]) - _sane(feat_d["c1_p50_ms"])
        assert cost["plain_overhead_ms"] == pytest.approx(plain, abs=2e-3), name
        assert cost["feature_overhead_ms"] == pytest.approx(feature, abs=2e-3), name
        assert cost["extra_ms_per_request"] == pytest.approx(feature - plain, abs=4e-3), name
        assert cost["extra_us_per_token"] == pytest.approx(cost["extra_ms_per_request"] * 1000 / 4, abs=0.02), name
        # the router's CPU per request, from /proc, with and without the feature, on the same router process
        assert cost["plain_cpu_us_per_request"] == _sane(plain_r["cpu_us_per_request"]) >= 0
        assert cost["feature_cpu_us_per_request"] == _sane(feat_r["cpu_us_per_request"]) >= 0
        extra_cpu = cost["feature_cpu_us_per_request"] - cost["plain_cpu_us_per_request"]
        assert cost["extra_cpu_us_per_request"] == pytest.approx(extra_cpu, abs=0.1), name
        assert cost["extra_cpu_us_per_token"] == pytest.approx(extra_cpu / 4, abs=0.01), name
        assert "cpu_us_per_request" not in feat_d  # straight to the workers: no router to count


def test_grpc_bench_prices_logprobs_and_a_json_object_against_the_plain_path(
    runs: dict[str, subprocess.Popen[str]],
) -> None:
    res = _result(runs["grpc"])
    assert res["api"] == "grpc"
    assert res["overhead_p50_ms"]["64"] == res["features"]["logprobs"]["64"]["plain_overhead_ms"]
    _check_line(res, "router", "json")


def test_http_bench_prices_logprobs_and_a_json_schema_against_the_plain_path(
    runs: dict[str, subprocess.Popen[str]],
) -> None:
    res = _result(runs["http"])
    assert res["api"] == "http"
    _check_line(res, "kvmesh", "json_schema")
