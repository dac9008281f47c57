"""`kvmesh up --observe`: a real Prometheus (Debian's 2.42) scrapes a running suite with deploy/'s alert rules.

Checked through Prometheus's own HTTP API, polled with a bound: every service is an `up` target, every rule of
deploy/prometheus/alerts.yaml (alert and recording rules) is loaded and has been evaluated with health ok, and
every query of deploy/grafana/kvmesh-dashboard.json returns at least one series after two requests went through
the router (the second once Prometheus had scraped the counters the first created, so that rates are above 0).
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.core.ports import free_port
from kvmesh.suite import observe
from tests.support.cli import kvmesh_cli

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[3]
UNSET = "0001-01-01T00:00:00Z"  # Prometheus's lastEvaluation of a rule never evaluated


def _api(url: str, path: str, **params: str) -> Any:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{url}/api/v1/{path}{query}", timeout=10) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", body
    return body["data"]


def _until(what: str, check: Callable[[], list[str]], timeout_s: float = 90) -> None:
    """Polls `check` (the list of what is still wrong) until it is empty; fails naming what stayed wrong."""
    deadline = time.monotonic() + timeout_s
    wrong = check()
    while wrong and time.monotonic() < deadline:
        time.sleep(0.5)  # Prometheus scrapes and evaluates on its own clock (5 s): poll its API
        wrong = check()
    assert not wrong, f"{what} after {timeout_s:.0f} s: {wrong}"


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    home = tmp_path_factory.mktemp("observe")
    port = free_port()
    up = kvmesh_cli(
        home, "up", "--detach", "--ports", "auto", "--observe", "--prometheus-port", str(port), "--workers", "2"
    )
    assert up.returncode == 0, up.stdout + up.stderr
    state = json.loads((home / "run" / "suite.json").read_text())
    try:
        demo = kvmesh_cli(home, "demo", "--max-tokens", "8")  # observations for the router's histograms
        assert demo.returncode == 0, demo.stdout + demo.stderr
        # the ratio rules (prefill share, cache miss, retries, cost per token) need a rate above 0: a second
        # request once Prometheus holds the first one's counts and a sample of every worker's counters (they
        # exist at 0 from the start), so whichever worker serves it, two of its samples differ
        url = state["prometheus"]["url"]
        scraped = (
            "sum(kvmesh_router_requests_total) > 0",
            "sum(kvmesh_worker_prompt_tokens_total) > 0",
            "count(kvmesh_worker_prompt_tokens_total) >= 2",
        )
        _until("first request not scraped", lambda: [q for q in scraped if not _api(url, "query", query=q)["result"]])
        demo = kvmesh_cli(home, "demo", "--max-tokens", "8")
        assert demo.returncode == 0, demo.stdout + demo.stderr
        yield state
    finally:
        down = kvmesh_cli(home, "down")
        assert down.returncode == 0, down.stdout + down.stderr
    assert observe.gone(int(state["prometheus"]["pid"])), "kvmesh down left Prometheus running"


def test_every_service_is_an_up_target(suite: dict[str, Any]) -> None:
    url = suite["prometheus"]["url"]
    want = {f"127.0.0.1:{s['http_port']}" for s in suite["services"]}

    def not_up() -> list[str]:
        active = _api(url, "targets")["activeTargets"]
        up = {t["labels"]["instance"] for t in active if t["health"] == "up"}
        return sorted(want - up)

    _until("targets not up", not_up)
    assert {t["labels"]["job"] for t in _api(url, "targets")["activeTargets"]} == {
        "router",
        "worker",
        "cache-manager",
        "failover",
        "planner",
    }


def test_every_alert_rule_is_loaded_and_evaluated(suite: dict[str, Any]) -> None:
    url = suite["prometheus"]["url"]
    spec = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yaml").read_text())
    want = {r.get("alert") or r["record"] for g in spec["groups"] for r in g["rules"]}

    def loaded() -> dict[str, dict[str, Any]]:
        return {r["name"]: r for g in _api(url, "rules")["groups"] for r in g["rules"]}

    assert set(loaded()) == want
    _until("rules not evaluated", lambda: sorted(n for n, r in loaded().items() if r["lastEvaluation"] == UNSET))
    bad = {n: (r["health"], r.get("lastError")) for n, r in loaded().items() if r["health"] != "ok"}
    assert bad == {}


def test_every_dashboard_query_returns_series(suite: dict[str, Any]) -> None:
    url = suite["prometheus"]["url"]
    dash = json.loads((ROOT / "deploy/grafana/kvmesh-dashboard.json").read_text())
    exprs = {t["expr"] for p in dash["panels"] for t in p["targets"]}
    assert len(exprs) >= 10

    def empty() -> list[str]:
        return sorted(e for e in exprs if not _api(url, "query", query=e)["result"])

    _until("queries without a series", empty)
