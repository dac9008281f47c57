"""The tiny local test model (no model hub here): built once by scripts/build_tiny_model.py, idempotent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvmesh.suite.launcher import ServiceProcess, start_service, vllm_core_env

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
SHARED_MAX_MODEL_LEN = 1024  # the tool-call module's prompt (the Hermes tools preamble) alone is ~520 tokens


class SharedVllmWorker:
    """One vLLM worker (`start_vllm_worker`, block size `SHARED_BLOCK_SIZE`, `SHARED_MAX_MODEL_LEN`) for every
    test module that tests through a worker of that configuration: a vLLM start costs most of a minute on
    CI's two cores. `get()` starts it on first use (or again after `stop()`); `stop()` expects exit code 0
    on SIGTERM, as each module's own worker did. Its engine is unpinned with an equal share of the cores as
    its thread count, as a module may run a second engine beside it (vLLM's own server, for comparison).
    What a module asserts of cached tokens or KV events concerns prompts that share no block with another's."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.worker: ServiceProcess | None = None

    def get(self) -> ServiceProcess:
        if self.worker is None:
            self.worker = start_vllm_worker(
                self.directory,
                block_size=SHARED_BLOCK_SIZE,
                max_model_len=SHARED_MAX_MODEL_LEN,
                env=vllm_core_env(2, pinned=False)[0],
            )
        assert self.worker.proc.poll() is None, f"the shared vLLM worker exited:\n{self.worker.log()[-3000:]}"
        return self.worker

    def stop(self) -> None:
        worker, self.worker = self.worker, None
        if worker is not None:
            assert worker.terminate(timeout=60) == 0, worker.log()[-3000:]
