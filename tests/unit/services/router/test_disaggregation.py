"""The prefill half the router sends (`prefill_request`): the request's prompt under its own block salts
(tenant, LoRA), compute-only with the hold asked; and which requests may be disaggregated (`pd_eligible`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import cast

import pytest

from kvmesh.core.generation import SamplingParams
from kvmesh.routing import InflightTracker
from kvmesh.routing.circuit import BreakerConfig, CircuitBreaker
from kvmesh.routing.types import CircuitState
from kvmesh.services.router import disaggregation
from kvmesh.services.router.disaggregation import Disaggregation, PdSettings, PrefillHalf, pd_eligible, prefill_request
from kvmesh.services.router.limits import CoreLimits
from kvmesh.services.router.request import RouterRequest
from kvmesh.services.router.workers import WorkerPool
from kvmesh.v1 import common_pb2, worker_pb2

pytestmark = pytest.mark.unit


def test_the_prefill_half_keeps_the_request_s_salts_and_asks_for_the_hold() -> None:
    sampling = SamplingParams(max_tokens=64, n=3, logprobs=2, temperature=0.7)
    req = RouterRequest.checked(CoreLimits(), "r1", list(range(3, 300)), sampling, tenant="acme", lora="lo")
    got = worker_pb2.GenerateRequest.FromString(prefill_request("r1.prefill", req, 4000))
    assert list(got.token_ids.ids) == list(range(3, 300))
    assert (got.tenant, got.lora_name) == ("acme", "lo")  # the same block identities as the decode half's
    assert got.prefill_only and got.hand_off_ms == 4000
    assert got.sampling.max_tokens == 1 and got.sampling.n in (0, 1) and not got.sampling.logprobs
    assert got.request_id == "r1.prefill"


def test_only_a_first_attempt_without_prompt_logprobs_may_be_disaggregated() -> None:
    plain = RouterRequest.checked(CoreLimits(), "r1", [5, 6, 7], SamplingParams())
    assert pd_eligible(plain, [])
    assert not pd_eligible(plain, [9])  # a migration resumes aggregated
    asks = RouterRequest.checked(CoreLimits(), "r2", [5, 6, 7], SamplingParams(prompt_logprobs=1))
    assert not pd_eligible(asks, [])  # only the worker that computes the prompt can give them


class _Call:
    """A prefill half's worker call: one final response with the handoff."""

    def __init__(self) -> None:
        resp = worker_pb2.GenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)
        resp.handoff.num_blocks = 4
        resp.handoff.source_worker_id = "p0"
        self._resps = [resp]

    def __aiter__(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        return self._steps()

    async def _steps(self) -> AsyncIterator[worker_pb2.GenerateResponse]:
        for r in self._resps:
            yield r

    def done(self) -> bool:
        return True


class _Handle:
    def __init__(self) -> None:
        self.breaker = CircuitBreaker(BreakerConfig())
        self.selections_total = 0

    async def generate(self, rid: str, request: bytes, carrier: dict[str, str], sequences: int = 1) -> _Call:
        return _Call()


async def test_long_prefill_halves_never_open_the_prefill_worker_s_circuit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill half lasts as long as its prompt and queue make it (5 s each here): the breaker, which samples
    inter-token gaps above its 1200 ms p95, must not take that for a sick worker."""
    clock = iter(range(0, 10_000, 5))  # perf_counter: every half takes 5 s
    monkeypatch.setattr(disaggregation.time, "perf_counter", lambda: float(next(clock)))
    handle = _Handle()
    pool = SimpleNamespace(by_id={"p0": handle}, mark_failed=lambda *a: None)
    pd = Disaggregation(PdSettings(), cast(WorkerPool, pool), InflightTracker())
    req = RouterRequest.checked(CoreLimits(), "r", list(range(3, 300)), SamplingParams())
    for i in range(30):  # past the breaker's 20-sample minimum
        handed = await pd.prefill(f"r{i}", req, PrefillHalf("p0", 297), 32)
        assert handed.handoff is not None and handed.handoff.num_blocks == 4
    assert handle.breaker.view_state(time.monotonic()) is CircuitState.CLOSED
