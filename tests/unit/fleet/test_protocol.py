"""The evaluation protocol on traces it was not tuned on: unservable requests, capacity 0, the common load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvmesh.bench.fleet import main as fleet_main
from kvmesh.fleet.evaluate import FALLBACK_LOAD_SCALE, common_load_scale
from kvmesh.fleet.report import policy_names, targets

pytestmark = pytest.mark.unit

CONTEXT = 131_072


def write_mooncake(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    """Rows of (timestamp ms, input_length, output_length, hash_ids) as a Mooncake JSONL file."""
    with path.open("w") as f:
        for ts, n_in, n_out, ids in rows:
            f.write(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}))
            f.write("\n")
    return path


def small_trace_with_overlong(path: Path, overlong: int = 3) -> Path:
    """24 short prompts (1.5–3K tokens, two shared system prefixes) over 60 s, and ``overlong`` prompts longer
    than the model's context (131,072 tokens), like the held-out trace of the data-plane study."""
    rows: list[tuple[int, int, int, list[int]]] = []
    nxt = 1000
    for i in range(24):
        n_in = 1536 + 512 * (i % 4)
        own = list(range(nxt, nxt + 4))
        nxt += 4
        ids = [i % 2, 2 + i % 2, *own][: -(-n_in // 512)]
        rows.append((2500 * i, n_in, 16 + i % 5, ids))
    for j in range(overlong):
        n_in = CONTEXT + 4096 + 512 * j
        k = -(-n_in // 512)
        rows.append((2500 * (3 + 7 * j) + 1, n_in, 32, list(range(nxt, nxt + k))))
        nxt += k
    rows.sort(key=lambda r: r[0])
    return write_mooncake(path, rows)


def run_bench(trace: Path, out: Path, *extra: str) -> dict[str, Any]:
    argv = ["--trace", str(trace), "--workers", "2", "--policies", "round_robin,kvmesh", "--out", str(out)]
    argv += ["--skip-studies", "--bisect-window-s", "0", "--jobs", "1", *extra]
    assert fleet_main(argv) == 0
    res: dict[str, Any] = json.loads((out / "results.json").read_text())
    return res


def test_a_trace_with_prompts_beyond_the_context_gives_a_report(tmp_path: Path) -> None:
    """The data-plane study: before the fix this raised ``RuntimeError: round_robin never meets the SLO``."""
    trace = small_trace_with_overlong(tmp_path / "t.jsonl")
    res = run_bench(trace, tmp_path / "out")
    assert (tmp_path / "out" / "report.md").is_file()
    assert res["round_robin"]["slo_capacity"] > 0
    assert res["load_scale"] > 0
    gone = res["trace_unservable"]
    assert gone == {
        "count": 3,
        "of_requests": 27,
        "reasons": {"context": 3},
        "dropped_followups": 0,
        "indices": [4, 12, 20],
    }
    assert res["load_scale_rule"] == res["protocol"]["load_scale_rule"]
    for p in ("round_robin", "kvmesh"):
        x = res[p]
        ex, abs_ = x["ttft_excess_ms"], x["ttft_ms"]
        assert 0 <= ex["p50"] <= ex["p90"] <= ex["p99"]
        assert all(ex[q] <= abs_[q] for q in ("p50", "p90", "p99"))  # the ideal TTFT is > 0
        assert x["slo_probes"][0] == {"scale": 0.5, "meets": True}
        assert x["goodput"] > 0.5  # the 3 removed requests do not count against it
    md = (tmp_path / "out" / "report.md").read_text()
    assert "3 of the trace's 27 requests can never be served" in md
    assert "TTFT excess p99" in md and "by the rule: 1.25 x round_robin" in md


def test_a_slo_no_policy_meets_gives_capacity_0_and_the_fallback_load(tmp_path: Path) -> None:
    trace = small_trace_with_overlong(tmp_path / "t.jsonl", overlong=1)
    res = run_bench(trace, tmp_path / "out", "--ttft-mode", "absolute", "--ttft-slo-s", "0.01")
    assert res["load_scale"] == FALLBACK_LOAD_SCALE
    assert "no baseline meets the SLO" in str(res["load_scale_rule"])
    for p in ("round_robin", "kvmesh"):
        x = res[p]
        assert x["slo_capacity"] == 0.0
        scales = [q["scale"] for q in x["slo_probes"]]
        assert not any(q["meets"] for q in x["slo_probes"]) and min(scales) == pytest.approx(1 / 64)
        assert x["ttft_ms"]["p99"] > 0  # still measured at the fallback load
    md = (tmp_path / "out" / "report.md").read_text()
    assert "| round_robin | 0.000 |" in md and "no baseline meets the SLO" in md


def test_common_load_scale_has_a_rule_for_every_outcome() -> None:
    assert common_load_scale({"round_robin": 0.2, "kvmesh": 0.7, "dynamo": 0.4}) == (
        pytest.approx(0.25),
        "1.25 x round_robin's slo_capacity",
    )
    scale, rule = common_load_scale({"round_robin": 0.0, "kvmesh": 0.9, "kvmesh_dp": 2.0, "dynamo": 0.4, "llm_d": 0.3})
    assert scale == 0.4 and "(dynamo)" in rule  # kvmesh and its variants are not baselines
    assert common_load_scale({"round_robin": 0.0, "kvmesh": 0.9})[0] == FALLBACK_LOAD_SCALE
    assert common_load_scale({"round_robin": 0.0, "dynamo": 0.0})[0] == FALLBACK_LOAD_SCALE


def _entry(cap: float, excess_p99: float) -> dict[str, object]:
    return {
        "slo_capacity": cap,
        "ttft_ms": {"p50": 1.0, "p90": 2.0, "p99": 3000.0},
        "ttft_excess_ms": {"p50": 1.0, "p90": 2.0, "p99": excess_p99},
        "hit_ratio": 0.2,
        "pooled_lru_hit_ratio": 0.2,
        "goodput": 0.9,
    }


def test_report_policies_ignore_the_run_keys_and_targets_need_kvmesh() -> None:
    res: dict[str, object] = {
        "round_robin": _entry(0.0, 9000.0),
        "dynamo": _entry(0.4, 2000.0),
        "kvmesh": _entry(0.7, 2500.0),
        "load_scale": 0.4,
        "load_scale_rule": "x",
        "trace_unservable": {"count": 0},
        "protocol": {"slo": {"ttft_s": 2.0}, "load_scale_rule": "x"},
        "pooled_lru_same_capacity_hit_ratio": 0.3,
    }
    assert policy_names(res) == ["round_robin", "dynamo", "kvmesh"]
    got = {name: ok for name, ok, _ in targets({"results": res})}
    assert got["TTFT excess p99 ≥ 3× lower than round_robin"] is True  # 9000 / 2500
    assert got["lowest TTFT excess p99 at load_scale"] is False  # dynamo's is lower
    assert got["slo_capacity ≥ 1.5× round_robin"] is True  # round_robin's capacity is 0
    assert targets({"results": {p: res[p] for p in ("round_robin", "dynamo")}}) == []


def test_a_trace_with_nothing_servable_still_gives_a_report(tmp_path: Path) -> None:
    n = CONTEXT + 8192
    k = -(-n // 512)
    trace = write_mooncake(tmp_path / "t.jsonl", [(0, n, 10, list(range(k))), (1000, n, 10, list(range(k, 2 * k)))])
    res = run_bench(trace, tmp_path / "out")
    assert res["trace_unservable"]["count"] == 2 and res["round_robin"]["slo_capacity"] == 0.0
    assert res["load_scale"] == FALLBACK_LOAD_SCALE
    assert "2 of the trace's 2 requests can never be served" in (tmp_path / "out" / "report.md").read_text()
