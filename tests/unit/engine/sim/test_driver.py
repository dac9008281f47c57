"""SimEngine (async driver) under a virtual clock: streaming, virtual timings, events, abort, admission."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.core.errors import ResourceExhausted, Unavailable
from kvmesh.core.generation import EngineOutput, EngineRequest, SamplingParams
from kvmesh.core.kvevents import BlockStored
from kvmesh.engine.base import Engine
from kvmesh.engine.clock import VirtualClock
from kvmesh.engine.sim.core import SimConfig
from kvmesh.engine.sim.driver import SimEngine
from kvmesh.engine.sim.perf import decode_step_time, step_time

pytestmark = pytest.mark.unit


async def collect(eng: SimEngine, req: EngineRequest) -> list[tuple[float, EngineOutput]]:
    return [(eng.clock.now(), o) async for o in eng.generate(req)]


async def test_streams_with_virtual_timing_and_publishes_events() -> None:
    clock = VirtualClock()
    eng = SimEngine(SimConfig(block_size=16, num_blocks=512), clock=clock)
    assert isinstance(eng, Engine)
    await eng.start()
    events = eng.kv_event_batches()
    try:
        prompt = tuple(range(1, 1500))
        outs = await collect(eng, EngineRequest("a", prompt, sampling=SamplingParams(max_tokens=3)))
        ttft = step_time([(1024, 0)], []) + step_time([(475, 1024)], [])
        assert outs[0][0] == pytest.approx(ttft)
        assert [o.time_s for t, o in outs] == pytest.approx([t for t, _ in outs])
        assert outs[-1][0] == pytest.approx(ttft + decode_step_time(1, 1500) + decode_step_time(1, 1501))
        assert [o.finished for _, o in outs] == [False, False, True]
        assert outs[0][1].text  # detokenised by the sim tokenizer
        got: list[int] = []
        async with asyncio.timeout(5):
            while len(got) < 1500 // 16:
                got += [h for e in await anext(events) if isinstance(e, BlockStored) for h in e.block_hashes]
        assert set(got) == eng.core.pool.cached_hashes()
        assert {h for e in await eng.dump_blocks() for h in e.block_hashes} == set(got)
        text = await collect(eng, EngineRequest("t", prompt="hello", sampling=SamplingParams(max_tokens=1)))
        assert text[-1][1].usage is not None and text[-1][1].usage.prompt_tokens == 5
    finally:
        await eng.stop()
    with pytest.raises(Unavailable):
        await anext(events)


async def test_closing_the_stream_aborts_and_queue_full_is_resource_exhausted() -> None:
    eng = SimEngine(SimConfig(block_size=16, num_blocks=64, max_waiting=1, max_num_seqs=1), clock=VirtualClock())
    await eng.start()
    try:
        gen = eng.generate(EngineRequest("a", tuple(range(1, 100)), sampling=SamplingParams(max_tokens=500)))
        await anext(gen)
        assert eng.core.pool.num_used > 0
        await gen.aclose()
        assert eng.core.pool.num_used == 0 and not eng.core.has_work()
        long = EngineRequest("b", tuple(range(1, 100)), sampling=SamplingParams(max_tokens=500))
        gb = eng.generate(long)
        await anext(gb)  # b runs (max_num_seqs=1)
        gc = eng.generate(EngineRequest("c", (1, 2, 3)))
        gc_first = asyncio.ensure_future(anext(gc))  # c waits in the queue (the only slot)
        async with asyncio.timeout(5):
            while eng.load_report().waiting < 1:  # until c's task has run up to its first await
                await asyncio.sleep(0)
        with pytest.raises(ResourceExhausted):
            await anext(eng.generate(EngineRequest("d", (1, 2, 3))))
        assert await eng.abort("b")
        assert (await gc_first).request_id == "c"
        await gc.aclose()
        await gb.aclose()
    finally:
        await eng.stop()
