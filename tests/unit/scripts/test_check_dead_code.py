"""scripts/check_dead_code.sh passes on the real tree and fails, naming file:line, on a planted unused function."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "check_dead_code.sh"

USED = """\
def used(x: int) -> int:
    return x + 1


print(used(1))
"""


def run_check(*paths: Path) -> subprocess.CompletedProcess[str]:
    # vulture comes from the venv that runs the tests
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(
        [str(SCRIPT), *map(str, paths)], capture_output=True, text=True, timeout=120, check=False, env=env
    )


def test_real_tree_passes() -> None:
    result = run_check()
    assert result.returncode == 0, result.stdout + result.stderr


def test_used_code_passes(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text(USED, encoding="utf-8")
    result = run_check(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("planted", "report"),
    [
        ("def forgotten() -> None:\n    pass\n", "unused function 'forgotten'"),
        ("class Forgotten:\n    pass\n", "unused class 'Forgotten'"),
        ("FORGOTTEN = 3\n", "unused variable 'FORGOTTEN'"),
    ],
)
def test_planted_dead_code_fails(tmp_path: Path, planted: str, report: str) -> None:
    (tmp_path / "mod.py").write_text(USED + "\n\n" + planted, encoding="utf-8")  # planted on line 8
    result = run_check(tmp_path)
    assert result.returncode != 0
    assert f"{tmp_path / 'mod.py'}:8: {report}" in result.stdout, result.stdout
