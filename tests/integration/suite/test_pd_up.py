"""`kvmesh up --prefill-workers 1 --decode-workers 1` (simulated workers): each worker serves in its role (as
`kvmesh workers` shows it from the router, and as the registry carries it), the OpenAI API
answers a completion with tokens, and the zone's planner sizes the two pools (`kvmesh planner`)."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.discovery.model import WORKER_ROLE_META
from tests.support.cli import kvmesh_cli
from tests.support.poll import wait_until

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    home = tmp_path_factory.mktemp("pd")
    up = kvmesh_cli(
        home,
        *("up", "--detach", "--ports", "auto", "--prefill-workers", "1", "--decode-workers", "1"),
        *("--set", "planner.intervalS=1"),  # a planning step a second, so that the test sees one
    )
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        yield home, json.loads((home / "run" / "suite.json").read_text())
    finally:
        down = kvmesh_cli(home, "down")
        assert down.returncode == 0, down.stdout + down.stderr


def test_each_worker_serves_in_its_role(suite: tuple[Path, dict[str, Any]]) -> None:
    home, state = suite
    listed = kvmesh_cli(home, "workers", "--json")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    roles = {w["id"]: w["role"] for w in json.loads(listed.stdout)["workers"]}
    assert roles == {"worker-local-0": "prefill", "worker-local-1": "decode"}
    text = kvmesh_cli(home, "workers")
    assert text.stdout.splitlines()[1].split()[:3] == ["WORKER", "ZONE", "ROLE"]
    registry = yaml.safe_load((Path(state["run_dir"]) / "registry.yaml").read_text())["instances"]
    assert {i["id"]: i["meta"].get(WORKER_ROLE_META) for i in registry if i["role"] == "worker"} == roles


def test_the_openai_api_answers_with_tokens(suite: tuple[Path, dict[str, Any]]) -> None:
    _, state = suite
    router = next(s for s in state["services"] if s["name"] == "router")
    token = Path(state["auth"]["tokens"]["client"]).read_text().strip()
    body = json.dumps({"prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 8}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{router['http_port']}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert reply.status == 200
        answer = json.loads(reply.read())
    assert answer["usage"]["completion_tokens"] > 0 and answer["choices"][0]["text"]


def test_the_planner_sizes_the_two_pools(suite: tuple[Path, dict[str, Any]]) -> None:
    home, _ = suite
    plans: list[dict[str, Any]] = []

    def planned() -> bool:
        out = kvmesh_cli(home, "planner", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        plans.append(json.loads(out.stdout))
        return plans[-1]["zones"][0]["last"] is not None

    wait_until(planned, timeout_s=30)
    pools = plans[-1]["zones"][0]["last"]["pools"]
    assert pools is not None  # a disaggregated zone's planner runs with --pools
    assert (pools["desired_prefill"], pools["desired_decode"]) == (1, 1)  # no load: each pool's minimum
    # the router lists no worker_role yet unless it carries the registry's meta: the pools as it lists them
    assert pools["prefill"] + pools["decode"] == 2 and pools["role_changes"] == []
