"""A vLLM engine's own handoff counts (its load report's `handoffs_*_total` and `nixl_*_total` extras) reach the
worker's metrics, one labelled gauge each; other extras do not."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from kvmesh.core.kvevents import LoadReport
from kvmesh.services.worker.metrics import observe_load

pytestmark = pytest.mark.unit


def test_engine_handoff_and_nixl_counts_are_exported() -> None:
    extra = {"handoffs_sent_total": 4.0, "handoffs_fallbacks_total": 1.0, "nixl_expired_total": 2.0, "other": 9.0}
    observe_load(LoadReport(worker_id="w", extra=extra))
    assert REGISTRY.get_sample_value("kvmesh_worker_engine_handoffs", {"event": "sent"}) == 4.0
    assert REGISTRY.get_sample_value("kvmesh_worker_engine_handoffs", {"event": "fallbacks"}) == 1.0
    assert REGISTRY.get_sample_value("kvmesh_worker_nixl", {"stat": "expired"}) == 2.0
    assert REGISTRY.get_sample_value("kvmesh_worker_engine_handoffs", {"event": "other"}) is None
