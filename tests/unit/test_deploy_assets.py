"""Deployment assets stay in step with the code: every metric an alert or a dashboard panel uses is exported."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\bkvmesh_[a-z0-9_]+")
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


def test_alert_rules_parse_and_use_exported_metrics() -> None:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yaml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert all(r.get("annotations", {}).get("summary") for g in rules["groups"] for r in g["rules"])
    assert _missing(exprs) == set()


def test_dashboard_parses_and_uses_exported_metrics() -> None:
    dash = json.loads((ROOT / "deploy/grafana/kvmesh-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert _missing(exprs) == set()
