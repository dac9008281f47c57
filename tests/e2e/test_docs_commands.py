"""The README's quick start and operations.md's commands run for real, as written, against one sim-engine suite.

Adapted for a test machine, and only that: the suite starts on `--ports auto` (added to `make run`'s `kvmesh up`;
`make run`'s `setup` prerequisite is skipped, the venv is already built), in a temporary working directory that
links the repository's `.venv` and `docs` (so `var/run/...` paths resolve as in the docs), the quick start's
`localhost:8000` is the router's auto port, and `kvmesh top` gets `--iterations 1` (it refreshes until Ctrl-C).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.docs import doc_commands as dc

pytestmark = [pytest.mark.integration]

OPERATIONS = (dc.REPO / "docs" / "operations.md").read_text(encoding="utf-8")
# (command as operations.md shows it, the exit status it documents)
CURATED = [
    ("kvmesh workers", 0),
    ("kvmesh zones", 0),
    ("kvmesh index", 0),
    ("kvmesh rebalance --prefill-weight 0.7 --decode-weight 0.3", 0),
    ("kvmesh weights --zones local=1 --versions v1=1", 0),
    ("kvmesh weights --rollback", 0),
    ("kvmesh workers --json", 0),
    ("kvmesh workers --token-file var/run/auth/client-demo.token", 3),
    ("kvmesh drain worker-local-1", 0),
    ("kvmesh undrain worker-local-1", 0),
]


def _sh(cwd: Path, line: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env["PATH"] = f"{cwd / '.venv' / 'bin'}:{env['PATH']}"  # operations.md: the venv first on PATH
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(done: subprocess.CompletedProcess[str], code: int = 0) -> str:
    out = done.stdout + done.stderr
    assert done.returncode == code, out
    assert "Traceback" not in out, out
    return done.stdout


def _quick_start() -> list[str]:
    block = next(b for b in dc.blocks(dc.REPO / "README.md") if any(t.strip() == "make run" for _, t in b.body))
    return [line for _, line in dc.command_lines(block)]


@pytest.fixture(scope="module")
def cwd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    where = tmp_path_factory.mktemp("docs")
    for name in (".venv", "docs"):
        (where / name).symlink_to(dc.REPO / name)
    make_run = re.search(r"^run:.*\n((?:\t.*\n)+)", (dc.REPO / "Makefile").read_text(), flags=re.MULTILINE)
    assert make_run, "the Makefile's run target"
    recipe = [ln.strip().replace("$(VENV)", ".venv/bin") for ln in make_run.group(1).splitlines()]
    assert recipe[0] == ".venv/bin/kvmesh up --detach"
    try:
        for line in recipe:
            _ok(_sh(where, line + (" --ports auto" if line.endswith(" up --detach") else ""), timeout=180))
        yield where
    finally:
        _sh(where, ".venv/bin/kvmesh down")


def test_readme_quick_start(cwd: Path) -> None:
    lines = _quick_start()
    assert lines[0] == "make run"  # run by the fixture
    state = json.loads((cwd / "var" / "run" / "suite.json").read_text())
    port = next(s["http_port"] for s in state["services"] if s["name"] == "router")
    for line in lines[1:]:
        line = line.split("  #")[0].strip().replace("localhost:8000", f"127.0.0.1:{port}")
        if line.endswith(" down"):
            continue  # the module's last test
        line = line + " --iterations 1" if line.endswith(" top") else line
        out = _ok(_sh(cwd, line, timeout=60))
        assert out.strip(), line
        if line.startswith("curl"):
            assert '"error"' not in out, (line, out)


def test_operations_commands(cwd: Path) -> None:
    for command, code in CURATED:
        assert command in OPERATIONS, f"not in docs/operations.md: {command}"
        _ok(_sh(cwd, command), code)
    _ok(_sh(cwd, "kvmesh demo"))
    _ok(_sh(cwd, "kvmesh logs router"))
    # without --force a drain that would leave the zone without a worker is refused (exit 1), with it it drains
    _ok(_sh(cwd, "kvmesh drain worker-local-1"))
    refused = _sh(cwd, "kvmesh drain worker-local-0")
    _ok(refused, 1)
    assert "--force" in refused.stderr
    _ok(_sh(cwd, "kvmesh drain worker-local-0 --force"))
    _ok(_sh(cwd, "kvmesh undrain worker-local-0 && kvmesh undrain worker-local-1"))
    _ok(_sh(cwd, "kvmesh status"))


def test_down_stops_it(cwd: Path) -> None:
    assert "kvmesh down" in OPERATIONS
    assert "suite stopped" in _ok(_sh(cwd, "kvmesh down"))
    _ok(_sh(cwd, "kvmesh status"), 1)
