"""In-flight tracker: own work counts until a load report that already includes it, or until it ends."""

import pytest

from kvmesh.routing.inflight import InflightTracker
from kvmesh.routing.types import WorkerView

pytestmark = pytest.mark.unit


def view(t: InflightTracker, w: str, prefill_tokens_queued: int = 0, decode_tokens_active: int = 0) -> WorkerView:
    """w's view after its last report (the report's fields given here) and this router's accounting."""
    v = WorkerView(w, prefill_tokens_queued=prefill_tokens_queued, decode_tokens_active=decode_tokens_active)
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
    v = view(t, "a", decode_tokens_active=300)
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
    assert view(t, "a", decode_tokens_active=50).inflight_decode_tokens == 0
    t.on_report("a", 5.0)
    t.assign("s", "a", 50, 50, 16, now=11.0)
    assert view(t, "a", decode_tokens_active=50).inflight_decode_tokens == 50


def test_a_report_taken_before_the_request_arrived_does_not_erase_it() -> None:
    """A report that arrives after an assignment but was taken before the worker saw the request (it says
    nothing is queued) still leaves this router's own outstanding work on the worker: the worker never looks
    idle while requests sent to it are on the wire (the lock-step herding seen over real vLLM workers)."""
    t = InflightTracker()
    t.assign("r", "a", prefill_tokens=512, kv_tokens=512, block_size=16, now=1.0)
    t.on_report("a", 1.2)  # arrives after the assignment, so it would count as including r
    v = view(t, "a")  # ... but it reports nothing queued
    assert (v.inflight_prefill_tokens, v.inflight_decode_tokens, v.inflight_kv_blocks) == (512, 512, 32)
    v = view(t, "a", prefill_tokens_queued=512, decode_tokens_active=512)  # it does include r: not twice
    assert (v.inflight_prefill_tokens, v.inflight_decode_tokens) == (0, 0)
    t.first_token("r")
    assert view(t, "a").inflight_prefill_tokens == 0
    t.finish("r")
    assert view(t, "a").inflight_decode_tokens == 0


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


def test_work_that_ended_after_the_report_comes_off_it_until_the_next() -> None:
    """A report taken before this router's requests on w passed prefill or finished still holds them: their
    part is taken off it (never more than it holds), and a newer report, which no longer holds them, resets."""
    t = InflightTracker()
    t.assign("r", "a", prefill_tokens=512, kv_tokens=512, block_size=16, now=1.0)
    t.assign("s", "a", prefill_tokens=512, kv_tokens=512, block_size=16, now=1.0)
    t.on_report("a", 2.0)  # holds both
    both = {"prefill_tokens_queued": 1024, "decode_tokens_active": 1024}
    v = view(t, "a", **both)
    assert (v.inflight_prefill_tokens, v.inflight_decode_tokens) == (0, 0)
    t.first_token("r")
    t.finish("s")
    v = view(t, "a", **both)  # the report still says 1024 / 1024: r's prefill and all of s are gone
    assert (v.prefill_tokens_queued + v.inflight_prefill_tokens, v.decode_tokens_active + v.inflight_decode_tokens) == (
        0,
        512,
    )
    v = view(t, "a", prefill_tokens_queued=100, decode_tokens_active=100)  # never below zero load
    assert (v.prefill_tokens_queued + v.inflight_prefill_tokens, v.decode_tokens_active + v.inflight_decode_tokens) == (
        0,
        512,  # r is still outstanding: the own-work floor
    )
    t.on_report("a", 3.0)  # taken after: holds r's decode only
    v = view(t, "a", decode_tokens_active=512)
    assert (v.inflight_prefill_tokens, v.inflight_decode_tokens) == (0, 0)


def test_requests_that_ended_after_the_report_are_counted_until_the_next() -> None:
    """A report of 3 running taken before 2 of this router's 3 requests finished: 2 ended (never more than
    the report's running + waiting); a newer report resets the count."""
    t = InflightTracker()
    for rid in ("r", "s", "u"):
        t.assign(rid, "a", prefill_tokens=512, kv_tokens=512, block_size=16, now=1.0)
    t.on_report("a", 2.0)
    t.finish("r")
    t.finish("s")
    v = WorkerView("a", running=3)
    t.apply([v])
    assert (v.ended_requests, v.inflight_requests) == (2, 1)
    v = WorkerView("a", running=1)  # a report that held fewer than ended
    t.apply([v])
    assert v.ended_requests == 1
    t.on_report("a", 3.0)
    v = WorkerView("a", running=1)
    t.apply([v])
    assert v.ended_requests == 0
    t.assign("w", "a", prefill_tokens=512, kv_tokens=512, block_size=16, now=4.0)
    t.finish("w")  # not in any report: nothing to take off
    t.apply([v])
    assert v.ended_requests == 0
