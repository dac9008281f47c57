"""`kvmesh up` starts zones and workers at the same time: a start that fails must take the others down with it."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.suite.local import _start_together

pytestmark = pytest.mark.integration


def test_a_failed_start_kills_what_the_others_started_and_raises_its_error(tmp_path: Path) -> None:
    started: list[ServiceProcess] = []
    up = threading.Event()

    def cache_manager() -> ServiceProcess:
        sp = start_service("cache-manager", tmp_path, "--block-size", "16")
        started.append(sp)
        up.set()
        return sp

    def broken_worker() -> list[ServiceProcess]:
        assert up.wait(60)  # fail only once the other start has a live process to clean up
        raise TimeoutError("worker not ready within 300s")

    with pytest.raises(TimeoutError, match="worker not ready"):
        _start_together([cache_manager, broken_worker])
    assert len(started) == 1
    assert started[0].proc.poll() is not None  # killed, not left running


def test_starts_run_together_and_return_everything_they_started(tmp_path: Path) -> None:
    barrier = threading.Barrier(2, timeout=60)  # each start waits for the other: serial starts would break it

    def start(meet: bool = True) -> ServiceProcess:
        if meet:
            barrier.wait()
        return start_service("cache-manager", tmp_path, "--block-size", "16")

    got = _start_together([start, lambda: [start(), start(meet=False)]])
    try:
        assert [sp.name for sp in got] == ["cache-manager"] * 3
        assert len({sp.address for sp in got}) == 3
    finally:
        for sp in got:
            sp.kill()
