"""The log repeat limit (kvmesh.telemetry.logging): decisions on an injected clock, the filter on real records."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from kvmesh.telemetry.logging import RepeatFilter, RepeatLimiter

pytestmark = pytest.mark.unit


def test_first_k_per_window_pass_and_the_window_end_reports_the_drops() -> None:
    lim: RepeatLimiter[str] = RepeatLimiter(limit=5, window_s=60.0)
    assert [lim.admit("a", float(t)) for t in range(8)] == [True] * 5 + [False] * 3
    assert lim.admit("b", 8.0)  # another key has its own window
    assert lim.expired(59.9) == []
    assert lim.expired(60.0) == [("a", 3)]  # "b" (started at 8) is still open and dropped nothing
    assert lim.admit("a", 60.0)  # a new window
    assert lim.expired(68.0) == []  # "b" ended without drops: nothing to report
    assert [lim.admit("b", 68.0 + t) for t in range(6)] == [True] * 5 + [False]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def collected() -> Iterator[tuple[logging.Logger, _Collect]]:
    log = logging.getLogger("kvmesh.test.repeats")
    handler = _Collect()
    handler.addFilter(RepeatFilter(RepeatLimiter(limit=2, window_s=10.0)))
    log.addHandler(handler)
    log.propagate = False
    yield log, handler
    log.removeHandler(handler)


def suppressed(logger: str, level: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_log_records_suppressed_total", {"logger": logger, "level": level}) or 0.0


def test_filter_keys_on_the_template_counts_drops_and_logs_one_summary(
    collected: tuple[logging.Logger, _Collect],
) -> None:
    log, handler = collected
    before = suppressed(log.name, "WARNING")

    def emit(msg: str, args: tuple[object, ...], at: float, level: int = logging.WARNING) -> None:
        record = log.makeRecord(log.name, level, __file__, 1, msg, args, None)
        record.created = at
        log.handle(record)

    for i in range(5):  # arguments differ, the template does not: still the same record
        emit("bad request %d from %s", (i, "client"), 1000.0 + i)
    emit("bad request %d from %s", (9, "client"), 1001.0, logging.ERROR)  # another level, another key
    assert [r.getMessage() for r in handler.records] == [
        "bad request 0 from client",
        "bad request 1 from client",
        "bad request 9 from client",
    ]
    assert suppressed(log.name, "WARNING") - before == 3
    emit("something else", (), 1010.0)  # after the window: the summary comes first
    assert [r.getMessage() for r in handler.records[3:]] == [
        "suppressed 3 similar records in 10s: bad request %d from %s",
        "something else",
    ]
    assert handler.records[3].levelno == logging.WARNING
