"""The worker's KV event log: sequence numbers, replay window, dumps consistent with the sequence. (Its
vLLM-wire encoder is tested in test_wire_vllm_events.py, the OpenAI helpers in test_openai_protocol.py.)"""

from __future__ import annotations

import pytest

from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.services.worker.kvlog import KvEventLog

pytestmark = pytest.mark.unit


def stored(*hs: int, parent: int | None = None) -> BlockStored:
    return BlockStored(tuple(hs), parent, tuple(range(2 * len(hs))), 2)


async def test_sequences_replay_window_and_dump() -> None:
    log = KvEventLog("w", "inst", buffer=3)
    cur = log.open_cursor()
    log.append([stored(1, 2)], 0.0)
    log.append([stored(3, parent=2)], 0.0)
    log.append([BlockRemoved((3,))], 0.0)
    log.append([stored(4, parent=2)], 0.0)
    assert log.last_seq == 4
    assert [cur.queue.get_nowait().sequence for _ in range(4)] == [1, 2, 3, 4]
    assert log.replay(1) is None  # seq 1 fell out of the 3-batch window
    assert [b.sequence for b in log.replay(2) or []] == [2, 3, 4]
    assert log.replay(5) == [] and log.replay(6) is None
    seq, dump = log.dump()
    assert seq == 4 and [d.block_hashes for d in dump] == [(1,), (2,), (4,)]
    assert [d.parent_block_hash for d in dump] == [None, 1, 2]
    log.append([AllBlocksCleared()], 0.0)
    assert log.dump() == (5, [])


async def test_slow_cursor_is_marked_lost() -> None:
    log = KvEventLog("w", "i", cursor_limit=2)
    cur = log.open_cursor()
    for h in range(3):
        log.append([stored(h)], 0.0)
    assert cur.lost and cur.queue.qsize() == 2
