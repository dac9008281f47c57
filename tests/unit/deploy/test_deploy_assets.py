"""Deployment assets stay in step with the code: every metric an alert, a recording rule or a dashboard panel uses
is exported, and every recorded series (`kvmesh:*`) they use is recorded in deploy/prometheus/alerts.yaml."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
METRIC = re.compile(r"\bkvmesh_[a-z0-9_]+")
RECORDED = re.compile(r"\bkvmesh:[a-z0-9_:]+")
SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


def _exported() -> set[str]:
    names: set[str] = set()
    for path in [*ROOT.joinpath("libs").rglob("*.py"), *ROOT.joinpath("services").rglob("*.py")]:
        names.update(re.findall(r'"(kvmesh_[a-z0-9_]+)"', path.read_text()))
    return names


def _base(name: str, exported: set[str]) -> str:
    if name in exported:
        return name
    for suffix in SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in exported:
            return name[: -len(suffix)]
        # prometheus_client adds _total to counters declared without it
        if suffix == "_total" and name in {e + "_total" for e in exported}:
            return name
    return name


def _missing(exprs: list[str]) -> set[str]:
    exported = _exported()
    used = {m for e in exprs for m in METRIC.findall(e)}
    assert used, "no kvmesh metric found"
    return {m for m in used if _base(m, exported) not in exported}


def _rules() -> list[dict[str, Any]]:
    return [
        r for g in yaml.safe_load((ROOT / "deploy/prometheus/alerts.yaml").read_text())["groups"] for r in g["rules"]
    ]


def _unrecorded(exprs: list[str]) -> set[str]:
    recorded = {r["record"] for r in _rules() if "record" in r}
    return {m for e in exprs for m in RECORDED.findall(e)} - recorded


def test_alert_rules_parse_and_use_exported_metrics() -> None:
    rules = _rules()
    alerts = [r for r in rules if "alert" in r]
    assert all(r.get("annotations", {}).get("summary") and r.get("for") for r in alerts)
    assert all(RECORDED.fullmatch(r["record"]) for r in rules if "record" in r), "recorded names are kvmesh:*"
    exprs = [r["expr"] for r in rules]
    assert _missing(exprs) == set()
    assert _unrecorded(exprs) == set()


def test_dashboard_parses_and_uses_exported_metrics() -> None:
    dash = json.loads((ROOT / "deploy/grafana/kvmesh-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert _missing(exprs) == set()
    assert _unrecorded(exprs) == set()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
