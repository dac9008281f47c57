"""Long/short admission: separate bounded queues and slots; full queue -> ResourceExhausted(retry_after)."""

import pytest

from kvmesh.core.errors import ResourceExhausted
from kvmesh.routing.admission import Admission, QueueLimits

pytestmark = pytest.mark.unit


def make() -> Admission:
    return Admission(short=QueueLimits(2, 2), long=QueueLimits(1, 1), long_prompt_tokens=2048)


def test_short_never_waits_behind_long() -> None:
    a = make()
    assert a.admit("L1", 5000, 0.0) is True
    assert a.admit("L2", 5000, 0.0) is False  # queued behind L1
    assert a.admit("S1", 100, 0.0) is True  # short runs although long is saturated
    assert a.admit("S2", 2048, 0.0) is True  # threshold is "over 2048"
    assert a.stats() == {"short": {"running": 2, "waiting": 0}, "long": {"running": 1, "waiting": 1}}


def test_full_queue_raises_with_retry_after_and_release_grants_fifo() -> None:
    a = make()
    a.admit("L1", 5000, 0.0)
    a.admit("L2", 5000, 0.0)
    with pytest.raises(ResourceExhausted) as ei:
        a.admit("L3", 5000, 0.0)
    assert ei.value.retry_after_s >= 1.0
    assert a.release("L1", 10.0) == ["L2"]
    assert a.is_running("L2")
    # service time EWMA grew to 0.8·1 + 0.2·10 = 2.8 s -> retry-after reflects it
    a.admit("L3", 5000, 10.0)
    with pytest.raises(ResourceExhausted) as ei:
        a.admit("L4", 5000, 10.0)
    assert ei.value.retry_after_s == pytest.approx(2.8 * 2 / 1)


def test_cancel_while_queued_and_duplicate_id() -> None:
    a = make()
    a.admit("L1", 5000, 0.0)
    a.admit("L2", 5000, 0.0)
    assert a.release("L2", 1.0) == []  # cancelled while waiting
    assert a.release("L1", 2.0) == []
    assert a.stats()["long"] == {"running": 0, "waiting": 0}
    a.admit("S", 1, 0.0)
    with pytest.raises(Exception, match="already admitted"):
        a.admit("S", 1, 0.0)


def test_waiting_requests_are_granted_lowest_priority_first_fifo_within_one() -> None:
    a = Admission(short=QueueLimits(1, 8), long=QueueLimits(1, 1))
    assert a.admit("run", 1, 0.0, priority=5) is True
    for rid, prio in (("p2a", 2), ("p0a", 0), ("pm1", -1), ("p2b", 2), ("p0b", 0)):
        assert a.admit(rid, 1, 0.0, priority=prio) is False
    order, last = [], "run"
    for t in range(5):
        (last,) = a.release(last, float(t))
        order.append(last)
    assert order == ["pm1", "p0a", "p0b", "p2a", "p2b"]  # lower value first; arrival order within a value


def test_priority_order_survives_cancelled_waiters() -> None:
    """A waiter cancelled before its turn is skipped, and a re-admitted id queues anew (behind its equals)."""
    a = Admission(short=QueueLimits(1, 64), long=QueueLimits(1, 1))
    a.admit("run", 1, 0.0)
    a.admit("x", 1, 0.0, priority=1)
    a.admit("y", 1, 0.0, priority=1)
    assert a.release("x", 0.0) == []  # cancelled while waiting
    a.admit("x", 1, 0.0, priority=1)  # again: now behind y
    for i in range(40):  # many cancelled waiters: the heap stays bounded by the live ones
        a.admit(f"c{i}", 1, 0.0, priority=-1)
        a.release(f"c{i}", 0.0)
    assert len(a._classes["short"].order) <= 2 * 2 + 16 + 1  # compacted: 2 live waiters, not 42 entries
    assert a.release("run", 1.0) == ["y"]
    assert a.release("y", 2.0) == ["x"]
    assert a.stats()["short"] == {"running": 1, "waiting": 0}


def test_all_at_priority_0_is_fifo() -> None:
    a = Admission(short=QueueLimits(2, 4), long=QueueLimits(1, 1))
    a.admit("r1", 1, 0.0)
    a.admit("r2", 1, 0.0)
    for rid in ("w1", "w2", "w3"):
        a.admit(rid, 1, 0.0)
    assert a.release("r1", 1.0) == ["w1"] and a.release("r2", 1.0) == ["w2"] and a.release("w1", 1.0) == ["w3"]
