"""`kvmesh.wire.ingest_log`: the cache-manager's log records and checkpoint pieces round-trip."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.core.kvevents import KvEvent, KvEventBatch
from kvmesh.wire import ingest_log as log
from tests.support.kv_strategies import kv_batch, kv_event

pytestmark = pytest.mark.unit


@settings(max_examples=60, deadline=None)
@given(kv_batch())
def test_batch_records_round_trip(b: KvEventBatch) -> None:
    rec = log.decode_record(log.encode_record(log.LogRecord(log.BATCH, b.worker_id, batch=b)))
    assert rec == log.LogRecord(log.BATCH, b.worker_id, batch=b)
    assert log.batch_from_wire(log.decode(log.encode(log.batch_to_wire(b)))) == b


@settings(max_examples=40, deadline=None)
@given(st.lists(kv_event(), max_size=5).map(tuple))
def test_dump_event_records_round_trip(events: tuple[KvEvent, ...]) -> None:
    rec = log.LogRecord(log.DUMP_EVENTS, "w", events=events)
    assert log.decode_record(log.encode_record(rec)) == rec


@pytest.mark.parametrize("kind", [log.DUMP_BEGIN, log.DUMP_END, log.REMOVE_WORKER, log.REPLAY_FAILED])
def test_marker_records_round_trip(kind: int) -> None:
    rec = log.LogRecord(kind, "w", instance_id="i", next_sequence=7)
    assert log.decode_record(log.encode_record(rec)) == rec
