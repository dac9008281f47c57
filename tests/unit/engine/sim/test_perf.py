"""The roofline performance model: closed-form values and regimes."""

from __future__ import annotations

import pytest

from kvmesh.engine.sim.perf import (
    H200_LLAMA70B_FP8 as M,
)
from kvmesh.engine.sim.perf import (
    PerfModel,
    chunked_prefill_time,
    decode_step_time,
    prefill_time,
    step_time,
)

pytestmark = pytest.mark.unit


def test_kv_bytes_per_token_from_model_shape() -> None:
    assert M.kv_bytes_per_token == 2 * 80 * 8 * 128 * 1  # 160 KiB per token, FP8 KV
    assert PerfModel(kv_bytes_per_elem=2.0).kv_bytes_per_token == 2 * M.kv_bytes_per_token


def test_decode_is_memory_bound_at_small_batch() -> None:
    t = decode_step_time(1, 1000)
    expected = (M.weight_bytes + M.kv_bytes_per_token * 1000) / (4.8e12 * M.bandwidth_efficiency)
    assert t == pytest.approx(expected + M.step_overhead_s)
    # per-token latency of a 70B FP8 model on one H200 is 15-25 ms
    assert 0.015 < t < 0.025


def test_decode_turns_compute_bound_at_large_batch() -> None:
    batch = 1024
    t = decode_step_time(batch, batch * 100)
    flops = 2 * M.n_params * batch + M.attn_flops_per_pair * batch * 100
    assert t == pytest.approx(flops / M.effective_flops + M.step_overhead_s)


def test_prefill_is_compute_bound_and_superlinear_in_context() -> None:
    t1k = prefill_time(1000)
    flops = 2 * M.n_params * 1000 + M.attn_flops_per_pair * 1000 * (1001 / 2)
    assert t1k == pytest.approx(flops / M.effective_flops + M.step_overhead_s)
    # attention makes the same chunk dearer on top of a longer context
    assert prefill_time(1024, 50_000) > prefill_time(1024, 0) * 1.5
    assert chunked_prefill_time(100_000) > 100 * chunked_prefill_time(1000)


def test_chunked_prefill_sums_chunk_steps() -> None:
    total = chunked_prefill_time(2500, chunk=1024)
    parts = step_time([(1024, 0)], []) + step_time([(1024, 1024)], []) + step_time([(452, 2048)], [])
    assert total == pytest.approx(parts)


def test_mixed_step_at_least_each_part_and_empty_step_free() -> None:
    mixed = step_time([(512, 0)], [2000] * 8)
    assert mixed >= prefill_time(512)
    assert mixed >= decode_step_time(8, 16000)
    assert step_time([], []) == 0.0


def test_kv_capacity_from_memory_budget() -> None:
    budget = 141e9 * 0.9 - 70.6e9 - M.activation_reserve_bytes
    assert M.kv_capacity_blocks(16) == int(budget // (M.kv_bytes_per_token * 16))
