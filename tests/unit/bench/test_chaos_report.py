"""The chaos campaign's soak figures, its history file and its command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench.chaos import main
from kvmesh.bench.chaos_check import RequestRecord
from kvmesh.bench.chaos_report import growth_per_hour, write_history
from kvmesh.bench.chaos_runner import Sample, pd_counters, scalar_metrics


def test_growth_per_hour_is_the_slope_over_the_last_instance_after_warm_up() -> None:
    samples = [Sample(t, "a/router", 100, 50.0 + t, 10, 4) for t in range(0, 40, 5)]  # an instance, then killed
    samples += [Sample(t, "a/router", 200, 80.0 + t / 60, 20 + (t >= 100), 4) for t in range(40, 300, 5)]
    samples += [Sample(t, "a/worker-0", 300, 1.0, 7, 9) for t in range(200, 240, 5)]  # sampled for 35 s only
    g = growth_per_hour(samples, warmup_s=40)
    assert g["a/router"]["rss_mb"] == pytest.approx(60.0, rel=1e-3)  # 1 MiB a minute, the first instance ignored
    assert g["a/router"]["threads"] == 0.0
    assert g["a/router"]["fds"] is not None and g["a/router"]["fds"] > 0
    assert g["a/router"]["tasks"] is None
    assert g["a/worker-0"] == {"rss_mb": None, "rss_pct": None, "fds": None, "threads": None, "tasks": None}


def test_a_late_restart_s_warm_up_is_left_out_and_the_longest_instance_measured() -> None:
    flat = [Sample(t, "a/worker-0", 100, 150.0, 12, 4) for t in range(0, 600, 10)]  # steady for 10 minutes
    late = [Sample(t, "a/worker-0", 200, 120.0 + (t - 600) / 2, 12, 4) for t in range(600, 700, 10)]
    g = growth_per_hour(flat + late, warmup_s=30)["a/worker-0"]
    assert g["rss_mb"] == 0.0 and g["rss_pct"] == 0.0  # the restarted one filling its pool is not a leak
    growing = [Sample(t, "b/router", 7, 100.0 + t / 360, 9, 2) for t in range(0, 3600, 60)]  # +10 MiB an hour
    g = growth_per_hour(growing, warmup_s=300)["b/router"]
    assert g["rss_mb"] == pytest.approx(10.0, rel=1e-3)
    assert g["rss_pct"] == pytest.approx(100 * 10.0 / 105.42, rel=2e-2)


def test_a_duration_too_short_for_every_kind_is_refused_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--duration-s", "30"])
    assert e.value.code == 2
    assert "--duration-s" in capsys.readouterr().err


def test_a_router_s_prefill_decode_counters_are_read_from_its_metrics() -> None:
    text = "\n".join(
        [
            "# TYPE kvmesh_pd_decisions_total counter",
            'kvmesh_pd_decisions_total{mode="disaggregated",reason="uncached"} 7.0',
            'kvmesh_pd_decisions_total{mode="disaggregated",reason="other"} 2.0',
            'kvmesh_pd_decisions_total{mode="aggregated",reason="cached"} 5.0',
            "# TYPE kvmesh_handoff_blocks_total counter",
            "kvmesh_handoff_blocks_total 410.0",
            "# TYPE kvmesh_handoff_fallbacks_total counter",
            'kvmesh_handoff_fallbacks_total{cause="prefill_failed"} 1.0',
            "# TYPE kvmesh_router_requests_total counter",
            'kvmesh_router_requests_total{api="grpc",outcome="ok"} 99.0',
        ]
    )
    assert pd_counters(text + "\n") == {
        "disaggregated": 9.0,
        "aggregated": 5.0,
        "handoff_blocks": 410.0,
        "fallback_prefill_failed": 1.0,
    }


def test_prefill_decode_zones_need_two_decode_workers(capsys: pytest.CaptureFixture[str]) -> None:
    """With one prefill and one decode worker a zone has a single worker that serves a request: one worker's
    fault takes the zone out, and the schedule's overlap rule (one zone always whole) would not hold."""
    with pytest.raises(SystemExit) as e:
        main(["--pd", "--workers-per-zone", "2", "--duration-s", "600"])
    assert e.value.code == 2
    assert "--workers-per-zone must be >= 3 with --pd" in capsys.readouterr().err


def test_asyncio_tasks_are_read_from_metrics_and_fitted_like_the_rest() -> None:
    text = "# TYPE kvmesh_asyncio_tasks gauge\nkvmesh_asyncio_tasks 41.0\n# TYPE other gauge\nother 3.0\n"
    assert scalar_metrics(text, ("kvmesh_asyncio_tasks",)) == {"kvmesh_asyncio_tasks": 41.0}
    assert scalar_metrics("kvmesh_asyncio_tasks NaN\n", ("kvmesh_asyncio_tasks",)) == {}
    leaking = [Sample(t, "a/router", 9, 100.0, 10, 4, 40 + t // 60) for t in range(0, 1200, 30)]  # +1 a minute
    g = growth_per_hour(leaking, warmup_s=60)["a/router"]
    assert g["tasks"] == pytest.approx(60.0, rel=0.05)
    unread = [Sample(t, "a/redis", 8, 10.0, 10, 4) for t in range(0, 1200, 30)]
    assert growth_per_hour(unread, warmup_s=60)["a/redis"]["tasks"] is None


def test_the_history_keeps_the_prompt_of_a_failed_request_only(tmp_path: Path) -> None:
    """A failed request's prompt is in the history, to judge it again (a real engine's traffic may not draw it
    again from the seed); the others' are left out (they replay from it)."""
    fine, wrong = (RequestRecord(rid, "grpc", "short", 0.0, 30.0, outcome="ok", ended=1.0) for rid in "ab")
    for r, got in ((fine, [1, 2]), (wrong, [1, 3])):
        r.prompt, r.expected, r.received = [7, 8, 9], [[1, 2]], [got]
    rows = [json.loads(line) for line in write_history(tmp_path, [], [], [fine, wrong], []).read_text().splitlines()]
    assert [(row["rid"], row.get("prompt")) for row in rows] == [("a", None), ("b", [7, 8, 9])]
