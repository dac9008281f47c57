"""The vLLM engine adapter follows vLLM's KV events through `kvmesh.wire` and keeps KV-cache group 0 only:
a frame that also carries another group's blocks (hybrid models) does not put them into the mirror (which
serves dumps, hence the index) nor into the event stream. Real vLLM publisher, real ZMQ on ipc://."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from kvmesh.core.kvevents import BlockStored
from kvmesh.engine.vllm_config import VllmEngineConfig
from kvmesh.engine.vllm_engine import VllmEngine

kv = pytest.importorskip("vllm.distributed.kv_events")
pytestmark = pytest.mark.integration
BS = 4


def frame(i: int) -> object:
    """Batch i: block 1000+i of group 0 and block 2000+i of group 1, same tokens."""
    toks = list(range(i * BS, (i + 1) * BS))

    def stored(h: int, group: int) -> object:
        return kv.BlockStored(
            block_hashes=[h], parent_block_hash=None, token_ids=toks, block_size=BS, lora_id=None, medium="GPU",
            lora_name=None, group_idx=group,
        )  # fmt: skip

    return kv.KVEventBatch(ts=float(i), events=[stored(1000 + i, 0), stored(2000 + i, 1)])


async def test_only_kv_group_0_reaches_the_mirror_and_the_stream(tmp_path: Path) -> None:
    eng = VllmEngine(VllmEngineConfig(model="unused", worker_id="v"))
    stream = eng.kv_event_batches()
    pub = kv.ZmqEventPublisher(
        0, endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay", buffer_steps=1000
    )
    sub = eng.follow_kv_events(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay")
    try:
        sent = 0
        for _ in range(100):  # slow joiner: publish until the adapter has seen a live batch
            pub.publish(frame(sent))
            sent += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sub.progress.wait(), 0.2)
                break
        assert sub.received >= 1
        want = {1000 + i for i in range(sent)}
        for _ in range(100):  # bounded: the earlier batches arrive by replay
            if want <= eng.mirror.hashes():
                break
            sub.progress.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sub.progress.wait(), 0.2)
        assert eng.mirror.hashes() == want
        streamed: set[int] = set()
        for _ in range(sent + 10):
            if len(streamed) >= sent:
                break
            evs = await asyncio.wait_for(anext(stream), 5)
            streamed |= {h for e in evs if isinstance(e, BlockStored) for h in e.block_hashes}
        assert streamed == want
    finally:
        await stream.aclose()
        await eng.stop()
        pub.shutdown()
