"""The tiny local test model (no model hub here): built once by scripts/build_tiny_model.py, idempotent."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvmesh.suite.launcher import ServiceProcess, start_service, vllm_core_env

if TYPE_CHECKING:
    from kvmesh.engine.vllm_config import VllmEngineConfig
    from kvmesh.engine.vllm_engine import VllmEngine

ROOT = Path(__file__).resolve().parents[2]


def tiny_model() -> str:
    """The tiny model's folder (built on first use; the script leaves an up-to-date folder as it is)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_tiny_model.py")],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out.stdout.strip().splitlines()[-1]


def start_vllm_worker(
    directory: Path, *args: str, block_size: int = 32, max_model_len: int = 512, env: dict[str, str] | None = None
) -> ServiceProcess:
    """A worker serving the tiny model on real vLLM (bfloat16, the CPU's fast path), ready to serve."""
    return start_service(
        "worker",
        directory,
        "--engine",
        "vllm",
        "--model",
        tiny_model(),
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(max_model_len),
        "--vllm-dtype",
        "bfloat16",
        *args,
        env=env,
        timeout=300,
    )


SHARED_BLOCK_SIZE = 32
SHARED_MAX_MODEL_LEN = 4096  # the pull module's ~4K-token prompts (the tool-call module's is ~520 tokens)
SHARED_PULL_TIMEOUT_MS = 20_000  # the workers' cap on a pull's deadline (the pull module's hints ask for less)


def start_shared_config_worker(directory: Path, *extra: str) -> ServiceProcess:
    """A vLLM worker with the shared one's settings (`SharedVllmWorker`): block size `SHARED_BLOCK_SIZE`,
    `SHARED_MAX_MODEL_LEN`, a 64 MiB CPU tier, pulls capped at `SHARED_PULL_TIMEOUT_MS`. Its engine is
    unpinned with half the cores as its thread count: a second engine may run beside it (a module's second
    worker, vLLM's own server for comparison), and neither spins on the other's cores."""
    return start_vllm_worker(
        directory,
        *("--cpu-tier-mb", "64", "--pull-timeout-ms", str(SHARED_PULL_TIMEOUT_MS)),
        *extra,
        block_size=SHARED_BLOCK_SIZE,
        max_model_len=SHARED_MAX_MODEL_LEN,
        env=vllm_core_env(2, pinned=False)[0],
    )


def staging_region(worker: ServiceProcess) -> str:
    """The path of the pull staging region a worker process keeps until it stops."""
    from kvmesh.kvplane.kvsync.tier import SHM_DIR, region_name
    from kvmesh.kvplane.staging import STAGING_TAG

    return str(Path(SHM_DIR) / region_name(STAGING_TAG, worker.proc.pid))


class SharedVllmWorker:
    """One vLLM worker (`start_shared_config_worker`) for every test module that tests through a worker of
    those settings: a vLLM start costs most of a minute on CI's two cores. `get()` starts it on first use (or
    again after `stop()`); `stop()` expects exit code 0 on SIGTERM and no staging region left behind, as each
    module's own worker did. What a module asserts of cached tokens, KV events or metrics concerns prompts
    that share no block with another module's, or counts from before to after its own requests."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.worker: ServiceProcess | None = None

    def get(self) -> ServiceProcess:
        if self.worker is None:
            self.worker = start_shared_config_worker(self.directory)
        assert self.worker.proc.poll() is None, f"the shared vLLM worker exited:\n{self.worker.log()[-3000:]}"
        return self.worker

    def stop(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            assert worker.terminate(timeout=60) == 0, worker.log()[-3000:]
            assert not Path(staging_region(worker)).exists(), "the shared worker left its staging region behind"


ENGINE_BLOCK_SIZE = 32
ENGINE_MAX_MODEL_LEN = 4096  # the connector module's ~4K-token prompts


def vllm_engine_config(name: str, scratch: Path) -> VllmEngineConfig:
    """An in-process engine's settings (`kvmesh.engine.vllm_engine`, the tiny model, bfloat16, 1 GiB of KV
    cache), its connector's CPU tier a 64 MiB region of a name of its own."""
    from kvmesh.engine.vllm_config import VllmEngineConfig

    return VllmEngineConfig(
        model=tiny_model(),
        block_size=ENGINE_BLOCK_SIZE,
        max_model_len=ENGINE_MAX_MODEL_LEN,
        dtype="bfloat16",
        scratch_dir=str(scratch),
        cpu_kvcache_space_gib=1,
        worker_id=name,
        kv_tier_name=f"kvmesh-test-{name}-{random.randrange(1 << 32):08x}",
        kv_tier_bytes=64 << 20,
    )


class SharedVllmEngine:
    """One in-process vLLM engine (`vllm_engine_config`, named "shared") for the modules that test the adapter
    and its connector on it: a vLLM start costs most of a minute on CI's two cores. It lives on pytest-asyncio's
    session event loop (vLLM's output handler runs on the loop that started it), so its users run there too
    (`loop_scope="session"`). `get()` starts it on first use; `stop()` stops it from outside that loop.
    What a module asserts of cached tokens or KV events concerns prompts that share no block with another's."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.engine: VllmEngine | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    async def get(self) -> VllmEngine:
        from kvmesh.engine.vllm_engine import VllmEngine

        if self.engine is None:
            engine = VllmEngine(vllm_engine_config("shared", self.scratch))
            await asyncio.wait_for(engine.start(), timeout=400)
            self.engine, self.loop = engine, asyncio.get_running_loop()
        assert self.loop is asyncio.get_running_loop(), "the shared vLLM engine's users run on the session loop"
        return self.engine

    async def aclose(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            await asyncio.wait_for(engine.stop(), timeout=60)

    def stop(self) -> None:
        """Stops it between tests (its loop is not running then)."""
        if self.engine is not None and self.loop is not None:
            self.loop.run_until_complete(self.aclose())
