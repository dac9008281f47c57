"""The admin CLI against a remote router that checks API keys (no authorisation table): an admin key by flag
or by `KVMESH_API_KEY` works, a client key is denied with exit 3."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.suite.launcher import ServiceProcess, start_service
from tests.support.cli import kvmesh_cli

pytestmark = [pytest.mark.integration]
BS = 32
KEYS = """
- {key: sk-ops, id: ops, role: admin}
- {key: sk-alice, id: alice, tenants: [alice]}
"""


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    tmp = tmp_path_factory.mktemp("keyed")
    (tmp / "keys.yaml").write_text(KEYS)
    started: list[ServiceProcess] = []
    try:
        cm = start_service("cache-manager", tmp, "--block-size", str(BS), timeout=60)
        started.append(cm)
        flags = ("--engine", "sim", "--sim-speed", "0", "--block-size", str(BS), "--cache-manager", cm.address)
        worker = start_service("worker", tmp, *flags, timeout=60)
        started.append(worker)
        flags = ("--workers", worker.address, "--block-size", str(BS), "--cache-manager", cm.address)
        r = start_service("router", tmp, *flags, "--api-keys-file", str(tmp / "keys.yaml"), timeout=60)
        started.append(r)
        yield r
    finally:
        for sp in reversed(started):
            assert sp.terminate(timeout=30) == 0


def test_admin_api_key_by_flag_and_env(router: ServiceProcess, tmp_path: Path) -> None:
    done = kvmesh_cli(tmp_path, "workers", "--router", router.address, "--api-key", "sk-ops", "--json")
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["workers"]) == 1
    done = kvmesh_cli(
        tmp_path,
        "rebalance",
        "--prefill-weight",
        "1",
        "--decode-weight",
        "1",
        "--json",
        env={"KVMESH_ROUTER": router.address, "KVMESH_API_KEY": "sk-ops"},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["prefill_weight"] == pytest.approx(0.5)


def test_client_api_key_is_denied(router: ServiceProcess, tmp_path: Path) -> None:
    done = kvmesh_cli(tmp_path, "workers", "--router", router.address, "--api-key", "sk-alice")
    assert done.returncode == 3 and done.stdout == ""
    assert "PERMISSION_DENIED, needs role admin" in done.stderr, done.stderr
    done = kvmesh_cli(tmp_path, "workers", "--router", router.address)  # no key at all
    assert done.returncode == 3, done.stderr
