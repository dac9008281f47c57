"""Report rendering and the target checks, on a hand-made evaluation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvmesh.fleet.metrics import Slo
from kvmesh.fleet.policies import ALL_POLICIES
from kvmesh.fleet.report import targets, write_report
from kvmesh.fleet.sim import FleetConfig

pytestmark = pytest.mark.unit


def _entry(cap: float, p99: float, hit: float, good: float) -> dict[str, object]:
    return {
        "slo_capacity": cap,
        "ttft_ms": {"p50": 100.0, "p90": 500.0, "p99": p99},
        "e2e_ms": {"p50": 1000.0, "p99": 9000.0},
        "hit_ratio": hit,
        "pooled_lru_hit_ratio": 0.2,
        "output_tokens_per_s": 500.0,
        "goodput": good,
        "util_variance": 0.001,
    }


def _ev() -> dict[str, Any]:
    res: dict[str, Any] = {p: _entry(1.0, 9000.0, 0.05, 0.9) for p in ALL_POLICIES}
    res["kvmesh"] = _entry(1.6, 2500.0, 0.195, 0.99)
    res["load_scale"] = 1.25
    summary = {
        "itl_ms": {"p99": 90.0},
        "util_cv": 0.1,
        "cost_per_mtok": 0.5,
        "e2e_ms": {"p50": 1.0, "p99": 2.0},
        "ttft_ms": {"p50": 1.0, "p90": 1.0, "p99": 1.0},
        "hit_ratio": 0.1,
        "util_mean": 0.5,
        "util_variance": 0.01,
        "warm_requests": 0,
    }
    runs = {
        p: {"summary": summary, "util_series": {"w00": [0.5, 0.7], "w01": [0.1]}, "ttft_s": [0.1, 0.5, 2.0]}
        for p in ALL_POLICIES
    }
    caps = {p: {"probes": [{"scale": 1.0, "meets": True}]} for p in ALL_POLICIES}
    return {
        "results": res,
        "runs": runs,
        "capacities": caps,
        "trace": "t.jsonl",
        "wall_s": 60.0,
        "reference": {"pooled_lru_hit_ratio": 0.2, "ideal_hit_ratio": 0.37, "fleet_kv_blocks": 9584},
        "config": FleetConfig(slo=Slo()),
        "bisect_window_s": 900.0,
        "cpu_count": 2,
        "notes": ["n1"],
        "warming": {"workload": {}, "runs": {"none": {"summary": summary}}},
        "concurrent": {"clients": 32, "workers": 8, "runs": {"kvmesh": {"summary": summary}}},
    }


def test_targets_pass_and_fail_as_the_numbers_say() -> None:
    ev = _ev()
    got = {name: ok for name, ok, _ in targets(ev)}
    assert all(got.values()), got
    worse = dict(ev["results"])
    worse["kvmesh"] = _entry(1.4, 3100.0, 0.18, 0.99)
    got = {name: ok for name, ok, _ in targets({"results": worse})}
    assert got["slo_capacity ≥ 1.5× round_robin"] is False
    assert got["TTFT p99 ≥ 3× lower than round_robin"] is False
    assert got["hit_ratio ≥ 95 % of pooled LRU"] is False
    assert got["highest slo_capacity"] is True


def test_write_report_makes_markdown_and_plots(tmp_path: Path) -> None:
    write_report(_ev(), tmp_path)
    md = (tmp_path / "report.md").read_text()
    for png in ("ttft_cdf.png", "hit_ratio.png", "capacity.png", "load_over_time.png"):
        assert (tmp_path / png).stat().st_size > 1000
        assert f"({png})" in md
    assert "| kvmesh | 1.600 |" in md and "32 concurrent long requests" in md and "Warming" in md
