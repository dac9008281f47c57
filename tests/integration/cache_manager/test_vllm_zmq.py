"""ZMQ ingestion against vLLM's own publisher (`vllm.distributed.kv_events.ZmqEventPublisher`).

Real vLLM publisher code and real ZMQ sockets (ipc:// endpoints in a tmp dir: nothing on the network).
The batches are built by `ToyEngine` (a stand-in for the scheduler that normally feeds the publisher),
converted to vLLM's own event classes with sha256-style *bytes* engine hashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path

import pytest

from kvmesh.cachemgr.hasher import IndexHasher
from kvmesh.cachemgr.ingest import Ingestor, Phase
from kvmesh.core.kvevents import BlockRemoved, BlockStored, KvEventBatch
from kvmesh.index import PrefixIndex
from kvmesh.wire.zmq_subscriber import VllmZmqSubscriber
from tests.unit.cachemgr.test_ingest_state import BS, ToyEngine

kv = pytest.importorskip("vllm.distributed.kv_events")


def to_vllm(b: KvEventBatch) -> object:
    evs: list[object] = []
    for e in b.events:
        if isinstance(e, BlockStored):
            evs.append(
                kv.BlockStored(
                    block_hashes=[h.to_bytes(32, "big") for h in e.block_hashes],
                    parent_block_hash=None if e.parent_block_hash is None else e.parent_block_hash.to_bytes(32, "big"),
                    token_ids=list(e.token_ids),
                    block_size=e.block_size,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    group_idx=0,
                )
            )
        elif isinstance(e, BlockRemoved):
            evs.append(
                kv.BlockRemoved(block_hashes=[h.to_bytes(32, "big") for h in e.block_hashes], medium="GPU", group_idx=0)
            )
        else:
            evs.append(kv.AllBlocksCleared())
    return kv.KVEventBatch(ts=b.timestamp, events=evs)


async def wait_until(cond: object, sub: VllmZmqSubscriber, timeout_s: float = 20.0) -> None:
    """Wait on the subscriber's progress event until `cond()` holds (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not cond():  # type: ignore[operator]
        left = deadline - loop.time()
        assert left > 0, "timed out"
        sub.progress.clear()
        if cond():  # type: ignore[operator]
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sub.progress.wait(), min(left, 0.5))


def held(idx: PrefixIndex, w: str) -> set[int]:
    return set(idx.blocks_of(w).tolist())


async def scenario(
    tmp_path: Path, buffer_steps: int, lost: int
) -> tuple[Ingestor, PrefixIndex, ToyEngine, VllmZmqSubscriber]:
    hasher = IndexHasher("toy")
    idx = PrefixIndex()
    ing = Ingestor(idx, hasher, BS)
    eng = ToyEngine("vllm-0", hasher, seed=7)
    pub = kv.ZmqEventPublisher(
        0, endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay", buffer_steps=buffer_steps
    )
    rng = random.Random(1)
    prefixes = [[rng.randrange(1000) for _ in range(12)] for _ in range(3)]

    def publish_prompt() -> None:
        pub.publish(to_vllm(eng.prompt(rng.choice(prefixes) + [rng.randrange(1000) for _ in range(8)])))

    async def reset(worker: str) -> None:  # stand-in for POST /reset_prefix_cache: the engine clears
        pub.publish(to_vllm(eng.clear()))

    sub = VllmZmqSubscriber(
        "vllm-0", f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", ing, on_unrecoverable=reset, replay_timeout_s=5.0
    )
    for _ in range(lost):  # published before anyone subscribed: lost on the SUB socket
        publish_prompt()
    # wait until vLLM's publisher thread has actually sent them (its queue is joined after each send)
    await asyncio.wait_for(asyncio.to_thread(pub._event_queue.join), 10)
    stop = asyncio.Event()
    task = asyncio.create_task(sub.run(stop))
    try:
        for _ in range(100):  # slow joiner: publish until the subscriber has seen a live batch
            publish_prompt()
            try:
                await asyncio.wait_for(sub.progress.wait(), 0.2)
                break
            except TimeoutError:
                continue
        assert sub.received >= 1
        for i in range(30):
            if i % 4 == 3:
                pub.publish(to_vllm(eng.evict(3, rng)))
            else:
                publish_prompt()
        await wait_until(
            lambda: (
                "vllm-0" in ing.workers
                and ing.workers["vllm-0"].next_sequence == eng.seq
                and ing.workers["vllm-0"].phase is Phase.SYNCED
            ),
            sub,
        )
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        pub.shutdown()
    return ing, idx, eng, sub


@pytest.mark.integration
async def test_late_subscriber_replays_missed_batches(tmp_path: Path) -> None:
    _ing, idx, eng, sub = await scenario(tmp_path, buffer_steps=1000, lost=5)
    assert sub.tr.uses_vllm_classes
    assert sub.replays >= 1 and sub.replay_failures == 0
    assert held(idx, "vllm-0") == eng.truth() and len(eng.truth()) > 20


@pytest.mark.integration
async def test_unrecoverable_gap_resyncs_through_cache_reset(tmp_path: Path) -> None:
    _ing, idx, eng, sub = await scenario(tmp_path, buffer_steps=2, lost=6)
    assert sub.replay_failures >= 1
    assert held(idx, "vllm-0") == eng.truth() and len(eng.truth()) > 10
