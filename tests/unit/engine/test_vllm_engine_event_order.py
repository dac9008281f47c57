"""The vLLM adapter's sink behind the shared ZMQ subscriber: batches reach the mirror in sequence order,
exactly once; a gap asks for one replay; a failed replay gives up what was seen, then goes on."""

from __future__ import annotations

import pytest

from kvmesh.core.kvevents import KvEventBatch
from kvmesh.engine.vllm_engine import InOrderSink

pytestmark = pytest.mark.unit


def b(seq: int) -> KvEventBatch:
    return KvEventBatch("v", "g0", seq, 0.0, ())


def sink() -> tuple[InOrderSink, list[int | str]]:
    seen: list[int | str] = []
    return InOrderSink(lambda x: seen.append(x.sequence), lambda: seen.append("lost")), seen


def test_in_order_and_duplicates() -> None:
    s, seen = sink()
    for seq in (0, 1, 1, 0, 2):
        assert s.apply(b(seq)).resync is None
    assert seen == [0, 1, 2] and not s.is_replaying("v")


def test_a_gap_asks_one_replay_and_the_replay_fills_it() -> None:
    s, seen = sink()
    s.apply(b(0))
    res = s.apply(b(3))
    assert res.resync is not None and res.resync.from_sequence == 1 and not res.resync.full_dump
    assert s.apply(b(4)).resync is None  # already replaying
    assert s.is_replaying("v") and seen == [0]
    s.apply(b(1))
    s.apply(b(2))
    assert seen == [0, 1, 2, 3, 4] and not s.is_replaying("v")


def test_a_failed_replay_loses_then_delivers_the_held_batches() -> None:
    s, seen = sink()
    s.apply(b(5))
    s.apply(b(6))
    s.replay_failed("v")
    assert seen == ["lost", 5, 6] and not s.is_replaying("v")
    s.apply(b(7))
    assert seen[-1] == 7
