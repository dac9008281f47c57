"""In-flight tracker: own work counts until a load report that already includes it, or until it ends."""

import pytest

from kvmesh.routing.inflight import InflightTracker
from kvmesh.routing.types import WorkerView

pytestmark = pytest.mark.unit


def view(t: InflightTracker, w: str) -> WorkerView:
    v = WorkerView(w)
    t.apply([v])
    return v


def test_lifecycle() -> None:
    t = InflightTracker()
    t.assign("r1", "a", prefill_tokens=100, kv_tokens=300, block_size=16, now=1.0)
    t.assign("r2", "a", prefill_tokens=20, kv_tokens=300, block_size=16, now=2.0)
    v = view(t, "a")
    assert (v.inflight_prefill_tokens, v.inflight_decode_tokens, v.inflight_kv_blocks, v.inflight_requests) == (
        120,
        600,
        7 + 2,
        2,
    )
    t.first_token("r1")
    assert view(t, "a").inflight_prefill_tokens == 20
    t.on_report("a", 1.5)  # the report includes r1 but not r2
    v = view(t, "a")
    assert (v.inflight_prefill_tokens, v.inflight_decode_tokens, v.inflight_requests) == (20, 300, 2)
    t.finish("r1")
    t.finish("r2")
    t.finish("unknown")
    v = view(t, "a")
    assert (v.inflight_prefill_tokens, v.inflight_decode_tokens, v.inflight_kv_blocks, v.inflight_requests) == (
        0,
        0,
        0,
        0,
    )
    assert len(t) == 0


def test_reassign_moves_request_and_forget_worker() -> None:
    t = InflightTracker()
    t.assign("r", "a", 10, 10, 16, now=0.0)
    t.assign("r", "b", 10, 10, 16, now=0.1)  # retry elsewhere
    assert view(t, "a").inflight_requests == 0
    assert t.worker_of("r") == "b"
    assert t.forget_worker("b") == ["r"]
    assert view(t, "b").inflight_requests == 0
    assert t.worker_of("r") is None


def test_old_report_is_ignored_and_assign_before_report_is_reported() -> None:
    t = InflightTracker()
    t.on_report("a", 10.0)
    t.assign("r", "a", 50, 50, 16, now=9.0)  # assigned before the newest report: already in it
    assert view(t, "a").inflight_decode_tokens == 0
    t.on_report("a", 5.0)
    t.assign("s", "a", 50, 50, 16, now=11.0)
    assert view(t, "a").inflight_decode_tokens == 50


def test_replica_scaling_multiplies_only_unreported_sums() -> None:
    t = InflightTracker(replicas=3)
    t.assign("r", "a", prefill_tokens=32, kv_tokens=100, block_size=16, now=1.0)
    v = view(t, "a")
    assert (v.inflight_prefill_tokens, v.inflight_decode_tokens, v.inflight_kv_blocks, v.inflight_requests) == (
        96,
        300,
        6,
        1,
    )
    with pytest.raises(ValueError):
        InflightTracker(replicas=0)
