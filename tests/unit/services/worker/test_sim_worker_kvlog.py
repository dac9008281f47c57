"""The worker's KV event log: sequence numbers, replay window, dumps consistent with the sequence. (Its
vLLM-wire encoder is tested in test_wire_vllm_events.py, the OpenAI helpers in test_openai_protocol.py.)"""

from __future__ import annotations

import pytest

from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.services.worker.kvlog import DEFAULT_BUFFER_BLOCKS, KvEventLog

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


async def test_replay_buffer_is_bounded_in_blocks_not_only_in_batches() -> None:
    """Batches of long prompts (a 3000-token prompt stores ~100 blocks with their tokens) would otherwise
    fill 10,000 batches' worth of memory, tens of MB, before the batch count bounds them: the buffer keeps
    the newest batches up to `buffer_blocks` blocks, older replays answer None (the consumer dumps)."""
    log = KvEventLog("w", "i", buffer_blocks=500)
    for seq in range(1, 2001):
        log.append([stored(*range(seq * 100, seq * 100 + 95)), BlockRemoved((seq,))], 0.0)
    assert log.buffered_blocks <= 500  # 96 blocks a batch: the newest 5 batches
    assert [b.sequence for b in log.replay(1996) or []] == [1996, 1997, 1998, 1999, 2000]
    assert log.replay(1995) is None and log.replay(1) is None
    log.append([stored(*range(600))], 0.0)  # one batch over the whole bound: replaying it means a dump
    assert log.buffered_blocks == 0 and log.replay(2001) is None and log.replay(2002) == []
    log.append([BlockRemoved((1,)), AllBlocksCleared()], 0.0)
    assert log.buffered_blocks == 2 and [b.sequence for b in log.replay(2002) or []] == [2002]


async def test_default_replay_buffer_stays_small_under_long_prompts() -> None:
    """The worker's default log after 2,000 long-prompt batches holds a few thousand blocks, not all of them."""
    log = KvEventLog("w", "i")
    for seq in range(1, 2001):
        log.append([stored(*range(seq * 100, seq * 100 + 94))], 0.0)
    assert 0 < log.buffered_blocks <= DEFAULT_BUFFER_BLOCKS < 2000 * 94
    assert log.replay(1) is None
