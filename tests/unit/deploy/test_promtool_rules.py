"""CI guards: Prometheus's own checker accepts deploy/prometheus/alerts.yaml (syntax, PromQL, templates), its
unit tests (deploy/prometheus/alerts_test.yaml, `promtool test rules`) pass with a firing and a quiet case for
every alert, and promtool accepts the prometheus.yml that `kvmesh up --observe` writes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvmesh.suite import observe

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "deploy/prometheus/alerts.yaml"
RULE_TESTS = ROOT / "deploy/prometheus/alerts_test.yaml"


def _promtool() -> str:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/bootstrap.sh installs Debian's prometheus package"
    return promtool


def test_promtool_check_rules() -> None:
    out = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    groups = yaml.safe_load(RULES.read_text())["groups"]
    assert f"SUCCESS: {sum(len(g['rules']) for g in groups)} rules found" in out.stdout, out.stdout


def test_promtool_unit_tests_pass() -> None:
    out = subprocess.run([_promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout, out.stdout


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r}
    spec = yaml.safe_load(RULE_TESTS.read_text())
    assert spec["rule_files"] == ["alerts.yaml"]
    cases = [c for t in spec["tests"] for c in t.get("alert_rule_test", [])]
    firing = {c["alertname"] for c in cases if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in cases if not c.get("exp_alerts")}
    assert {c["alertname"] for c in cases} <= alerts, "a test names an alert alerts.yaml does not have"
    assert (alerts - firing, alerts - quiet) == (set(), set())


def test_promtool_accepts_the_config_kvmesh_observe_writes(tmp_path: Path) -> None:
    promtool = _promtool()
    state = {"services": [{"name": "router", "id": "router-local", "http_port": 9104}]}
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(observe.scrape_config(state, observe.ALERT_RULES, interval_s=5)))
    out = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
