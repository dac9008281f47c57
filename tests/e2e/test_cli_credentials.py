"""`kvmesh` as a new operator runs it from the docs: `kvmesh demo` on a suite whose router checks API keys (the
suite's own client credential by default, `--api-key` / `--token-file` to choose another), and no command ever
answers a failure with a traceback: one line on stderr naming the cause and the fix, a non-zero exit code."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import kvmesh_cli

pytestmark = [pytest.mark.integration]
KEYS = "- {key: sk-alice, id: alice, tenants: [alice]}\n"


def one_line_failure(done: subprocess.CompletedProcess[str], command: str, exit_code: int, *words: str) -> str:
    """`done` failed with `exit_code` and one stderr line, `kvmesh COMMAND: ...` holding every one of `words`."""
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == exit_code, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvmesh {command}: "), done.stderr
    assert all(w in lines[0] for w in words), (words, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A plaintext suite as the docs start one with API keys on: one sim worker, no planner."""
    home = tmp_path_factory.mktemp("keyed-suite")
    (home / "keys.yaml").write_text(KEYS)
    up = kvmesh_cli(
        home,
        *("up", "--detach", "--ports", "auto", "--workers", "1", "--set", "planner.enabled=false"),
        *("--set", f"router.apiKeysFile={home / 'keys.yaml'}"),
    )
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield home
    finally:
        down = kvmesh_cli(home, "down", timeout=120)
        assert down.returncode == 0, down.stdout + down.stderr


def test_demo_sends_the_suite_client_credential_or_the_one_given(home: Path) -> None:
    demo = kvmesh_cli(home, "demo", "--max-tokens", "4", timeout=120)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "completion=4" in demo.stdout and "OpenAI API http://127.0.0.1:" in demo.stdout, demo.stdout
    # the demo's own gRPC request and its OpenAI one run as the same tenant: the second finds the prompt cached
    assert "cached=0 " not in demo.stdout.rsplit("OpenAI API", 1)[1], demo.stdout
    as_alice = kvmesh_cli(home, "demo", "--max-tokens", "2", "--api-key", "sk-alice", timeout=120)
    assert as_alice.returncode == 0 and "completion=2" in as_alice.stdout, as_alice.stdout + as_alice.stderr
    state = json.loads((home / "run" / "suite.json").read_text())
    by_file = kvmesh_cli(home, "demo", "--max-tokens", "2", "--token-file", state["auth"]["tokens"]["client"])
    assert by_file.returncode == 0 and "completion=2" in by_file.stdout, by_file.stdout + by_file.stderr
    wrong = kvmesh_cli(home, "demo", "--api-key", "sk-wrong", timeout=120)
    one_line_failure(wrong, "demo", 3, "UNAUTHENTICATED", "unknown API key", "--api-key")
    workers = kvmesh_cli(home, "workers", "--json", timeout=60)  # the operator's credential, keys or not
    assert workers.returncode == 0 and len(json.loads(workers.stdout)["workers"]) == 1, workers.stderr


def test_failures_are_one_line_never_a_traceback(tmp_path: Path) -> None:
    """Errors forced in several commands, none of them with a suite: each one line naming the cause and fix."""
    one_line_failure(kvmesh_cli(tmp_path, "demo"), "demo", 2, "no local suite", "kvmesh up")
    refused = kvmesh_cli(tmp_path, "demo", "--router", "127.0.0.1:1", "--timeout", "5")
    one_line_failure(refused, "demo", 4, "UNAVAILABLE", "kvmesh status")
    missing = kvmesh_cli(tmp_path, "demo", "--router", "127.0.0.1:1", "--token-file", str(tmp_path / "nope"))
    one_line_failure(missing, "demo", 2, str(tmp_path / "nope"))
    (tmp_path / "blocker").write_text("a file where `kvmesh certs` wants a folder")
    one_line_failure(kvmesh_cli(tmp_path, "certs", str(tmp_path / "blocker")), "certs", 1, "File exists")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "suite.json").write_text("{half a state")
    for command in ("status", "down"):
        one_line_failure(kvmesh_cli(tmp_path, command), command, 2, "suite.json is not JSON", "remove it")
