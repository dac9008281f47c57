"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from kvmesh.suite.launcher import ServiceProcess
from tests.support.models import SharedVllmEngine, SharedVllmWorker
from tests.support.sim_worker import start_sim_worker

# Session fixtures over processes that several modules share, stopped right after the last collected test
# that uses them rather than at the session's end (an idle vLLM worker would otherwise hold its memory and
# processes through every later module).
SHARED_FIXTURES = ("shared_vllm_worker", "shared_vllm_engine")
_LAST_USER: dict[str, str] = {}  # fixture name -> node id of the last test that uses it
_STARTED: dict[str, SharedVllmWorker | SharedVllmEngine] = {}  # fixture name -> its value, once set up


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


@pytest_asyncio.fixture(loop_scope="session", scope="session")
async def shared_vllm_engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[SharedVllmEngine]:
    """The in-process vLLM engine the adapter's and the connector's modules share (`SharedVllmEngine`), on the
    session loop: started by the first `get()`, stopped after the last test that uses this fixture."""
    shared = SharedVllmEngine(tmp_path_factory.mktemp("shared-vllm-engine"))
    _STARTED["shared_vllm_engine"] = shared
    yield shared
    del _STARTED["shared_vllm_engine"]
    await shared.aclose()  # a no-op when its last user stopped it


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        for name in SHARED_FIXTURES:
            if name in getattr(item, "fixturenames", ()):
                _LAST_USER[name] = item.nodeid


def pytest_runtest_setup(item: pytest.Item) -> None:
    # on another loop, a test would wait forever for outputs the engine's handler (on the session loop) never reads
    mark = item.get_closest_marker("asyncio")
    if (
        "shared_vllm_engine" in getattr(item, "fixturenames", ())
        and mark
        and mark.kwargs.get("loop_scope") != "session"
    ):
        pytest.fail('the shared vLLM engine serves the session loop only: asyncio(loop_scope="session")')


@pytest.hookimpl(trylast=True)  # after the item's own fixtures (a module's router over the worker) are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for name, shared in _STARTED.items():
        if _LAST_USER.get(name) == item.nodeid:
            shared.stop()  # a failed stop is this test's teardown error
