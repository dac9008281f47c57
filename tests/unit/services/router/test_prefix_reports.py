"""The router's routed-prefix reports: a bounded queue that drops (and counts) when full, never waits, and a
loop that sends a batch as soon as it is full, else after `flush_s`, surviving failed sends."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY

from kvmesh.core.tasks import stop_task
from kvmesh.services.router.prefix_reports import PrefixReports
from kvmesh.v1 import cache_manager_pb2 as pb

pytestmark = pytest.mark.unit
HOUR = 3600.0  # a flush interval no test waits for
BS = 1  # tokens per block in most tests: a prompt of n blocks is n token ids


def reported(outcome: str) -> float:
    return REGISTRY.get_sample_value("kvmesh_router_prefix_reports_total", {"outcome": outcome}) or 0.0


class Sink:
    """A send function that records each request (and fails while `failing`)."""

    def __init__(self) -> None:
        self.requests: asyncio.Queue[pb.ReportRoutedPrefixesRequest] = asyncio.Queue()
        self.failing = False

    async def __call__(self, request: pb.ReportRoutedPrefixesRequest) -> None:
        self.requests.put_nowait(request)
        if self.failing:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata())

    async def next(self) -> pb.ReportRoutedPrefixesRequest:
        return await asyncio.wait_for(self.requests.get(), 10)


def test_an_entry_is_the_prompt_s_checkpoint_hashes() -> None:
    r = PrefixReports(Sink(), BS, max_queue=4)
    r.offer(list(range(100, 106)), 3, "A")  # 6 blocks: checkpoints 1, 2, 4, 6
    (e,) = r.take()
    assert (e.blocks, list(e.checkpoint_hashes), e.hit_blocks, e.tenant) == (6, [100, 101, 103, 105], 3, "A")


def test_a_full_queue_drops_and_counts_without_waiting() -> None:
    r = PrefixReports(Sink(), BS, max_queue=3, max_batch=2, flush_s=HOUR)
    before = reported("dropped")
    for i in range(5):
        r.offer([i], 0)  # synchronous: nothing here can wait on the sender
    assert [keys[0] for _blocks, keys, _hit, _tenant, _tokens, _n in r.queue] == [0, 1, 2]  # the oldest are kept
    assert reported("dropped") - before == 2
    off = PrefixReports(Sink(), BS, max_queue=0)
    off.offer([1], 0)
    assert not off.queue and reported("dropped") - before == 2  # 0 = reporting off, not drops


async def test_a_full_batch_is_sent_at_once_and_a_partial_one_after_the_interval() -> None:
    sink = Sink()
    r = PrefixReports(sink, BS, max_queue=100, max_batch=4, flush_s=HOUR)
    task = asyncio.create_task(r.run())
    try:
        before = reported("sent")
        for i in range(5):
            r.offer([i], 0)
        first = await sink.next()  # by size: the hour-long interval has not passed
        assert [e.checkpoint_hashes[0] for e in first.prefixes] == [0, 1, 2, 3]
        assert len(r.queue) == 1 and sink.requests.empty()  # the fifth waits for the interval or a full batch
        for i in range(5, 8):
            r.offer([i], 0)
        second = await sink.next()
        assert [e.checkpoint_hashes[0] for e in second.prefixes] == [4, 5, 6, 7]
        await asyncio.wait_for(_until(lambda: reported("sent") - before == 8), 10)
    finally:
        await stop_task(task)
    short = PrefixReports(sink, BS, max_queue=100, max_batch=4, flush_s=0.01)
    task = asyncio.create_task(short.run())
    try:
        short.offer([9], 0)
        assert [e.checkpoint_hashes[0] for e in (await sink.next()).prefixes] == [9]  # by time, not full
    finally:
        await stop_task(task)


async def test_a_failed_send_loses_its_batch_counted_and_the_loop_carries_on() -> None:
    sink = Sink()
    sink.failing = True
    r = PrefixReports(sink, BS, max_queue=100, max_batch=2, flush_s=HOUR)
    task = asyncio.create_task(r.run())
    try:
        failed, sent = reported("failed"), reported("sent")
        r.offer([1], 0)
        r.offer([2], 0)
        await sink.next()
        await asyncio.wait_for(_until(lambda: reported("failed") - failed == 2), 10)
        sink.failing = False
        r.offer([3], 0)
        r.offer([4], 0)
        assert [e.checkpoint_hashes[0] for e in (await sink.next()).prefixes] == [3, 4]
        await asyncio.wait_for(_until(lambda: reported("sent") - sent == 2), 10)
    finally:
        await stop_task(task)
    assert task.done()


async def _until(cond: Callable[[], bool]) -> None:
    """Yields to the loop until `cond()` holds (the caller bounds it with wait_for)."""
    while not cond():
        await asyncio.sleep(0)


async def test_the_token_ids_of_the_held_part_go_with_an_entry_up_to_the_cap() -> None:
    sink = Sink()
    r = PrefixReports(sink, 2, max_queue=10, max_batch=4, flush_s=HOUR, max_tokens=5)  # 2 tokens per block
    task = asyncio.create_task(r.run())
    try:
        r.offer([1, 2, 3, 4], 4, token_ids=np.arange(100, 108, dtype=np.uint32))  # all held: the cap, 5
        r.offer([5, 6, 7], 1, token_ids=[7, 8, 9, 10, 11, 12])  # 1 block held: its 2 ids, not the tail
        r.offer([8], 0, token_ids=[1, 2])  # nothing held: nothing worth sending
        r.offer([9], 1)  # no ids given
        sent = await sink.next()
        assert [list(p.token_ids) for p in sent.prefixes] == [[100, 101, 102, 103, 104], [7, 8], [], []]
        off = PrefixReports(sink, 2, max_tokens=0)
        off.offer([5], 1, token_ids=[1, 2, 3])
        assert [list(p.token_ids) for p in off.take()] == [[]]  # 0: never sent
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def carried(r: PrefixReports) -> list[bool]:
    """Which of the queued entries carry token ids (the queue is emptied)."""
    return [bool(p.token_ids) for p in r.take()]


def test_a_held_prefix_s_tokens_go_once_per_resend_interval() -> None:
    clock = Clock()
    r = PrefixReports(Sink(), BS, max_queue=100, max_batch=100, flush_s=HOUR, tokens_resend_s=5.0, clock=clock)
    for _ in range(3):
        r.offer([1, 2, 3], 3, token_ids=[7] * 3)  # held up to hash 3
    r.offer([1, 2, 4], 3, token_ids=[8] * 3)  # another held prefix (shares a part): its own tokens
    r.offer([1, 2, 5], 2, token_ids=[9] * 3)  # held up to hash 2: a prefix of its own
    r.offer([9], 1)  # no tokens to send: remembers nothing
    r.offer([9], 1, token_ids=[1])
    r.offer([1, 2, 6], 2, token_ids=[9] * 3)  # the same held prefix (hash 2) as two lines up
    assert carried(r) == [True, False, False, True, True, False, True, False]
    clock.now += 4.9
    r.offer([1, 2, 3], 3, token_ids=[7] * 3)
    clock.now += 0.2  # 5.1 s after the first: due again
    r.offer([1, 2, 3], 3, token_ids=[7] * 3)
    r.offer([1, 2, 3], 3, token_ids=[7] * 3)
    assert carried(r) == [False, True, False]


def test_a_dropped_entry_does_not_count_as_its_tokens_sent() -> None:
    r = PrefixReports(Sink(), BS, max_queue=1, max_batch=10, flush_s=HOUR, clock=Clock())
    r.offer([1], 1, token_ids=[5])
    r.offer([2], 1, token_ids=[6])  # queue full: dropped
    assert carried(r) == [True]
    r.offer([2], 1, token_ids=[6])
    assert carried(r) == [True]


def test_the_memory_of_sent_tokens_is_bounded_oldest_out() -> None:
    r = PrefixReports(Sink(), BS, max_queue=100, max_batch=100, flush_s=HOUR, max_remembered=2, clock=Clock())
    for key in (1, 2, 3, 1, 3):  # 3 pushes out 1; 1 then pushes out 2; 3 is still remembered
        r.offer([key], 1, token_ids=[key])
    assert carried(r) == [True, True, True, True, False]


async def test_a_failed_send_forgets_which_tokens_went() -> None:
    sink = Sink()
    r = PrefixReports(sink, BS, max_queue=100, max_batch=1, flush_s=HOUR, clock=Clock())
    task = asyncio.create_task(r.run())
    try:
        r.offer([1], 1, token_ids=[5])
        assert list((await sink.next()).prefixes[0].token_ids) == [5]
        r.offer([1], 1, token_ids=[5])
        assert list((await sink.next()).prefixes[0].token_ids) == []  # sent 0 s ago
        sink.failing = True
        r.offer([2], 1, token_ids=[6])
        await sink.next()  # this send fails: the cache-manager may have missed key 1's tokens too
        sink.failing = False
        r.offer([1], 1, token_ids=[5])
        assert list((await sink.next()).prefixes[0].token_ids) == [5]
    finally:
        await stop_task(task)
