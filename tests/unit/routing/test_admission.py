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
