"""A worker process exports the GPUs and GPU-hour price it was started with (the cost rules' inputs), and refuses
to start on a bad price, naming the setting."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvmesh.suite.launcher import start_service

pytestmark = pytest.mark.integration

SIM = ("--engine", "sim", "--kv-blocks", "64", "--cpu-tier-mb", "0")


def test_started_worker_exports_its_gpus_and_price(tmp_path: Path) -> None:
    sp = start_service("worker", tmp_path, *SIM, "--gpus", "2", env={"KVMESH_GPU_HOUR_PRICE": "2.5"})
    try:
        lines = httpx.get(f"http://127.0.0.1:{sp.http_port}/metrics", timeout=10).text.splitlines()
    finally:
        assert sp.terminate(timeout=30) == 0
    assert "kvmesh_worker_gpus 2.0" in lines
    assert "kvmesh_worker_gpu_hour_price_usd 2.5" in lines


def test_negative_price_stops_the_worker_at_start(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"gpu_hour_price: must be a price in USD >= 0, got -1.0"):
        start_service("worker", tmp_path, *SIM, "--gpu-hour-price", "-1", timeout=30)
