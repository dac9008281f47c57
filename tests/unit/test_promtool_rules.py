"""CI guards: Prometheus's own checker accepts deploy/prometheus/alerts.yaml (syntax, PromQL, templates) and
the prometheus.yml that `kvmesh up --observe` writes."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvmesh import observe

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_promtool_check_rules() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/bootstrap.sh installs Debian's prometheus package"
    out = subprocess.run(
        [promtool, "check", "rules", str(ROOT / "deploy/prometheus/alerts.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    groups = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yaml").read_text())["groups"]
    assert f"SUCCESS: {sum(len(g['rules']) for g in groups)} rules found" in out.stdout, out.stdout


def test_promtool_accepts_the_config_kvmesh_observe_writes(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/bootstrap.sh installs Debian's prometheus package"
    state = {"services": [{"name": "router", "id": "router-local", "http_port": 9104}]}
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(observe.scrape_config(state, observe.ALERT_RULES, interval_s=5)))
    out = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
