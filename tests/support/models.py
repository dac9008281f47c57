"""The tiny local test model (no model hub here): built once by scripts/build_tiny_model.py, idempotent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvmesh.suite.launcher import ServiceProcess, start_service

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


def start_vllm_worker(directory: Path, *args: str, block_size: int = 32, max_model_len: int = 512) -> ServiceProcess:
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
        timeout=300,
    )
