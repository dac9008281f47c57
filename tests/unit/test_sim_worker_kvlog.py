"""The worker's KV event log (sequence numbers, replay window, dumps consistent with the sequence) and its
vLLM-wire encoder. (The OpenAI request helpers moved with their subject: tests/unit/test_openai_protocol.py.)"""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from kvmesh.services.worker.kvlog import KvEventLog
from kvmesh.services.worker.zmq_pub import encode_batch

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


def test_wire_encoding_matches_vllm_layout() -> None:
    batch = KvEventBatch("w", "i", 7, 1.5, (stored(1, 2), BlockRemoved((2,), "GPU"), AllBlocksCleared()))
    ts, events, rank = msgspec.msgpack.decode(encode_batch(batch))
    assert ts == 1.5 and rank == 0
    assert events[0] == {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [0, 1, 2, 3],
        "block_size": 2,
        "lora_id": None,
        "medium": None,
        "lora_name": None,
    }
    assert events[1] == {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}
    assert events[2] == {"type": "AllBlocksCleared"}
