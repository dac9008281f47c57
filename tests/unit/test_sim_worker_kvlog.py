"""The worker's KV event log (sequence numbers, replay window, dumps consistent with the sequence) and the
pure helpers of its OpenAI endpoint and vLLM-wire encoder."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.kvevents import AllBlocksCleared, BlockRemoved, BlockStored
from kvmesh.services.worker.kvlog import KvEventLog
from kvmesh.services.worker.openai_http import prompt_of, render_chat, sampling_from_body

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


def test_openai_helpers() -> None:
    assert render_chat([{"role": "user", "content": "hi"}]) == "<|user|>\nhi\n<|assistant|>\n"
    with pytest.raises(InvalidArgument):
        render_chat([])
    assert prompt_of({"prompt": [1, 2]}) == ((1, 2), None)
    assert prompt_of({"prompt": ["abc"]}) == (None, "abc")
    with pytest.raises(InvalidArgument) as ei:
        prompt_of({"prompt": 5})
    assert ei.value.field == "prompt"
    sp = sampling_from_body({"max_tokens": 7, "stop": "x", "temperature": 0}, chat=False)
    assert sp.max_tokens == 7 and sp.stop == ("x",) and sp.temperature == 0.0
    assert sampling_from_body({}, chat=True).max_tokens is None
    with pytest.raises(InvalidArgument) as ei:
        sampling_from_body({"n": 2}, chat=False)
    assert ei.value.field == "n"
