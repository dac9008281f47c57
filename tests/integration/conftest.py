"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvmesh.suite.launcher import ServiceProcess
from tests.support.models import SharedVllmWorker
from tests.support.sim_worker import start_sim_worker

# Session fixtures over processes that several modules share, stopped right after the last collected test
# that uses them rather than at the session's end (an idle vLLM worker would otherwise hold its memory and
# processes through every later module).
SHARED_FIXTURES = ("shared_vllm_worker",)
_LAST_USER: dict[str, str] = {}  # fixture name -> node id of the last test that uses it
_STARTED: dict[str, SharedVllmWorker] = {}  # fixture name -> its value, once set up


@pytest.fixture(scope="module")
def sim_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """One sim worker (`tests.support.sim_worker`, 20× speed) per test module; must exit 0 on SIGTERM."""
    sp = start_sim_worker(tmp_path_factory.mktemp("w"), "--sim-speed", "20")
    yield sp
    assert sp.terminate(timeout=30) == 0


@pytest.fixture(scope="session")
def shared_vllm_worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedVllmWorker]:
    """The vLLM worker the modules testing through the same configuration share (`SharedVllmWorker`): started
    by the first `get()`, stopped after the last test that uses this fixture."""
    shared = SharedVllmWorker(tmp_path_factory.mktemp("shared-vllm"))
    _STARTED["shared_vllm_worker"] = shared
    yield shared
    del _STARTED["shared_vllm_worker"]
    shared.stop()  # a no-op when its last user stopped it


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        for name in SHARED_FIXTURES:
            if name in getattr(item, "fixturenames", ()):
                _LAST_USER[name] = item.nodeid


@pytest.hookimpl(trylast=True)  # after the item's own fixtures (a module's router over the worker) are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for name, shared in _STARTED.items():
        if _LAST_USER.get(name) == item.nodeid:
            shared.stop()  # a failed stop is this test's teardown error
