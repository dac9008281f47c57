"""P/D handoff by vLLM's own transfer (NixlConnector beside kvmesh's connector) between two real in-process vLLM
engines, a prefill engine and a decode engine (started once for the module): the prefill half sends no token
and hands over vLLM's params; the decode half loads the prompt's blocks by NIXL, its greedy output equals an
aggregated run's and its KV events announce the received blocks; a handoff past its hold, a malformed one, or
one whose prefill engine is gone is computed, same output; the prefill engine frees unread blocks by NIXL's
lease and counts them. Needs NIXL (`scripts/bootstrap.sh --with-nixl`, `pip install kvmesh[nixl]`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from kvmesh.core.generation import FINISH_PREFILL_ONLY, EngineOutput, EngineRequest, SamplingParams
from kvmesh.core.kvevents import BlockStored, KvEvent, is_tier
from kvmesh.engine.vllm_config import nixl_importable
from kvmesh.engine.vllm_engine import VllmEngine
from tests.support.models import ENGINE_BLOCK_SIZE, vllm_engine_config

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_importable(), reason="needs NIXL: scripts/bootstrap.sh --with-nixl"),
]
BS = ENGINE_BLOCK_SIZE
HOLD_MS = 6_000  # NIXL's lease: whole seconds, at least 6 (`VllmEngineConfig.handoff_lease_s`)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0)


@dataclasses.dataclass
class PdEngines:
    prefill: VllmEngine
    decode: VllmEngine


@pytest_asyncio.fixture(loop_scope="session", scope="module")
async def engines(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[PdEngines]:
    """A prefill and a decode engine with NIXL (started together: each gets its own handshake port)."""

    def make(name: str) -> VllmEngine:
        cfg = vllm_engine_config(name, Path(tmp_path_factory.mktemp(name)))
        return VllmEngine(dataclasses.replace(cfg, engine_handoff=True, handoff_hold_ms=HOLD_MS))

    pd = PdEngines(make("pd-prefill"), make("pd-decode"))
    await asyncio.wait_for(asyncio.gather(pd.prefill.start(), pd.decode.start()), timeout=600)
    yield pd
    await asyncio.gather(pd.prefill.stop(), pd.decode.stop())


def prompt(k: int, n: int = 600) -> tuple[int, ...]:
    """A prompt of its own (token ids 200+ are the tiny model's clean text); prompts of different k share no
    block."""
    return (200 + k, *(200 + (i * 7 + k * 13) % 500 for i in range(1, n)))


async def collect(eng: VllmEngine, req: EngineRequest) -> list[EngineOutput]:
    async with asyncio.timeout(120):
        return [o async for o in eng.generate(req)]


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


async def aggregated(eng: VllmEngine, ids: tuple[int, ...], rid: str) -> list[int]:
    """The request's greedy output run whole on `eng`, its blocks dropped again (no later hit)."""
    out = tokens(await collect(eng, EngineRequest(rid, ids, sampling=GREEDY)))
    await eng.reset_prefix_cache()
    return out


async def count_passes(eng: VllmEngine, key: str, above: float) -> None:
    """Until the load report's counter `key` is above `above` (bounded in time). vLLM reports the connectors'
    stats with a later engine step: each wait runs one, a request of one token on a prompt of no full block."""
    async with asyncio.timeout(HOLD_MS / 1000 + 30):
        while eng.load_report().extra.get(key, 0.0) <= above:
            await collect(eng, EngineRequest(f"tick-{time.monotonic_ns()}", prompt(90, 8), sampling=ONE))


async def stored_blocks(it: AsyncIterator[list[KvEvent]], n_blocks: int) -> list[BlockStored]:
    """vLLM-pool stores until `n_blocks` blocks were announced (bounded in time)."""
    got: list[BlockStored] = []
    async with asyncio.timeout(30):
        while sum(len(e.block_hashes) for e in got) < n_blocks:
            got += [e for e in await anext(it) if isinstance(e, BlockStored) and not is_tier(e.medium)]
    return got


@pytest.mark.asyncio(loop_scope="session")
async def test_decode_half_loads_by_nixl_equals_aggregated_and_announces_blocks(engines: PdEngines) -> None:
    p, d = engines.prefill, engines.decode
    ids = prompt(1)
    want = await aggregated(d, ids, "agg-1")
    events = d.kv_event_batches()
    before = d.load_report().extra.get("nixl_transfers_total", 0.0)
    pre = await collect(p, EngineRequest("pre-1", ids, sampling=GREEDY, hand_off_ms=HOLD_MS))
    last = pre[-1]
    assert tokens(pre) == [] and last.finished and last.finish_reason == FINISH_PREFILL_ONLY  # no token sent
    h = last.handoff
    assert h is not None and h.source_worker_id == "pd-prefill" and h.cached_tokens == 0
    assert h.num_blocks == -(-len(ids) // BS)  # every block of the prompt, the partial last one too
    assert time.time() * 1000 < h.held_until_unix_ms <= time.time() * 1000 + HOLD_MS
    assert json.loads(h.engine_params_json)["do_remote_prefill"] is True
    dec = await collect(d, EngineRequest("dec-1", ids, sampling=GREEDY, handoff=h))
    assert tokens(dec) == want
    await count_passes(d, "nixl_transfers_total", before)  # loaded by NIXL, not computed
    assert d.handoff_counts()["handoffs_fallbacks_total"] == 0
    # the received blocks reach kvmesh's index as the decode engine's own stores
    full = len(ids) // BS
    stored = await stored_blocks(events, full)
    assert [t for e in stored for t in e.token_ids][: full * BS] == list(ids[: full * BS])
    await d.reset_prefix_cache()


@pytest.mark.asyncio(loop_scope="session")
async def test_handoff_past_its_hold_or_malformed_is_computed(engines: PdEngines) -> None:
    p, d = engines.prefill, engines.decode
    ids = prompt(2)
    want = await aggregated(d, ids, "agg-2")
    pre = await collect(p, EngineRequest("pre-2", ids, sampling=GREEDY, hand_off_ms=HOLD_MS))
    h = pre[-1].handoff
    assert h is not None
    void = dataclasses.replace(h, held_until_unix_ms=int(time.time() * 1000) - 1)
    assert tokens(await collect(d, EngineRequest("dec-2v", ids, sampling=GREEDY, handoff=void))) == want
    await d.reset_prefix_cache()
    malformed = json.dumps({**json.loads(h.engine_params_json), "remote_port": "x"})
    still_held = int(time.time() * 1000) + HOLD_MS
    other = dataclasses.replace(h, engine_params_json=malformed, held_until_unix_ms=still_held)
    assert tokens(await collect(d, EngineRequest("dec-2m", ids, sampling=GREEDY, handoff=other))) == want
    await d.reset_prefix_cache()
    counts = d.handoff_counts()
    assert counts["handoffs_void_total"] == 1 and counts["handoffs_refused_total"] == 1
    # nobody read those blocks: the prefill engine frees them when NIXL's lease ends, and counts them
    await count_passes(p, "nixl_expired_total", 0)


@pytest.mark.asyncio(loop_scope="session")
async def test_handoff_from_a_stopped_prefill_engine_is_computed(engines: PdEngines) -> None:
    """Last in the module: it stops the prefill engine."""
    p, d = engines.prefill, engines.decode
    ids = prompt(3)
    want = await aggregated(d, ids, "agg-3")
    pre = await collect(p, EngineRequest("pre-3", ids, sampling=GREEDY, hand_off_ms=HOLD_MS))
    h = pre[-1].handoff
    assert h is not None
    await p.stop()  # takes seconds: the handoff is taken as still held (a prefill worker dying within its hold)
    h = dataclasses.replace(h, held_until_unix_ms=int(time.time() * 1000) + HOLD_MS)
    fallbacks = d.handoff_counts()["handoffs_fallbacks_total"]
    assert tokens(await collect(d, EngineRequest("dec-3", ids, sampling=GREEDY, handoff=h))) == want
    await count_passes(d, "handoffs_fallbacks_total", fallbacks)  # NIXL's failed read, computed by vLLM
