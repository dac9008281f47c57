"""CI guard: Prometheus's own checker accepts deploy/prometheus/alerts.yaml (syntax, PromQL, templates)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

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
