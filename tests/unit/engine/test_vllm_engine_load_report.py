"""The vLLM adapter's load report counts the requests in flight at the moment it is taken, not what vLLM's
last scheduler step saw (those stats lag by a step and freeze when the engine goes idle)."""

from __future__ import annotations

import pytest

from kvmesh.engine.vllm_config import VllmEngineConfig
from kvmesh.engine.vllm_engine import VllmEngine, _InFlight, live_counts

pytestmark = pytest.mark.unit


def engine_with(inflight: list[_InFlight], stats_running: int, stats_waiting: int) -> VllmEngine:
    e = VllmEngine(VllmEngineConfig(model="tiny"))  # never started: load_report reads only its own state
    e._stats.running, e._stats.waiting = stats_running, stats_waiting
    e._inflight = {f"r{i}": f for i, f in enumerate(inflight)}
    return e


def test_requests_handed_to_vllm_count_before_its_next_step() -> None:
    # four prompts just handed to vLLM: its last stats (from before they arrived) say nothing runs
    r = engine_with([_InFlight(prompt_len=512) for _ in range(4)], 0, 0).load_report()
    assert (r.running, r.waiting) == (4, 0)
    assert r.prefill_tokens_queued == 4 * 512 and r.decode_tokens_active == 0


def test_stale_counts_after_a_burst_do_not_outlive_its_requests() -> None:
    # vLLM's last step saw 6 running and 3 waiting; all of them have finished since
    r = engine_with([], 6, 3).load_report()
    assert (r.running, r.waiting) == (0, 0)


def test_waiting_is_bounded_by_the_requests_still_before_their_first_token() -> None:
    decoding = [_InFlight(prompt_len=100, generated=5, first_token=True) for _ in range(2)]
    prefilling = [_InFlight(prompt_len=100)]
    assert live_counts(decoding + prefilling, 5) == (2, 1)
    assert live_counts(decoding + prefilling, 0) == (3, 0)
    assert live_counts(decoding + prefilling * 3, 2) == (3, 2)
