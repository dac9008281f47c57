"""Shared fixtures: real service processes on loopback, stopped at the end of each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.procs import ServiceProcess, start_service


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Callable[..., ServiceProcess]]:
    """`services("router", *flags)` starts a real service process; all are stopped (then killed) afterwards."""
    started: list[ServiceProcess] = []

    def start(name: str, *args: str, **kwargs: object) -> ServiceProcess:
        sp = start_service(name, tmp_path / "svc", *args, **kwargs)  # type: ignore[arg-type]
        started.append(sp)
        return sp

    yield start
    for sp in reversed(started):
        if sp.proc.poll() is None:
            try:
                sp.terminate(timeout=15)
            except Exception:
                sp.kill()
