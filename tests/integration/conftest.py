"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmesh.suite.launcher import ServiceProcess
from tests.support.sim_worker import start_sim_worker


@pytest.fixture(scope="module")
def sim_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """One sim worker (`tests.support.sim_worker`, 20× speed) per test module; must exit 0 on SIGTERM."""
    sp = start_sim_worker(tmp_path_factory.mktemp("w"), "--sim-speed", "20")
    yield sp
    assert sp.terminate(timeout=30) == 0
