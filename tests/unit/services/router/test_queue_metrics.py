"""The router's queue gauges are read from its admission queues at scrape time."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvmesh.routing import Admission, QueueLimits
from kvmesh.services.router.metrics import QueueCollector

pytestmark = pytest.mark.unit


def _scrape(collector: QueueCollector) -> dict[str, float]:
    reg = CollectorRegistry()
    reg.register(collector)
    out = {}
    for line in generate_latest(reg).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_scrape_reports_running_and_waiting_per_queue() -> None:
    adm = Admission(short=QueueLimits(1, 4), long=QueueLimits(1, 4), long_prompt_tokens=2048)
    c = QueueCollector()
    assert _scrape(c) == {}  # no admission queues yet: nothing to report
    c.admission = adm
    assert adm.admit("a", 10, 0.0) and not adm.admit("b", 10, 0.0) and not adm.admit("c", 10, 0.0)
    assert adm.admit("L", 5000, 0.0)
    m = _scrape(c)
    assert m['kvmesh_router_queue_running{queue="short"}'] == 1
    assert m['kvmesh_router_queue_length{queue="short"}'] == 2
    assert m['kvmesh_router_queue_running{queue="long"}'] == 1
    assert m['kvmesh_router_queue_length{queue="long"}'] == 0
    assert adm.release("a", 1.0) == ["b"]
    m = _scrape(c)
    assert m['kvmesh_router_queue_length{queue="short"}'] == 1
    assert m['kvmesh_router_queue_running{queue="short"}'] == 1
