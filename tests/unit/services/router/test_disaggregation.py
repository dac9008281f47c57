"""The prefill half the router sends (`prefill_request`): the request's prompt under its own block salts
(tenant, LoRA), compute-only with the hold asked; and which requests may be disaggregated (`pd_eligible`)."""

from __future__ import annotations

import pytest

from kvmesh.core.generation import SamplingParams
from kvmesh.services.router.disaggregation import pd_eligible, prefill_request
from kvmesh.services.router.limits import CoreLimits
from kvmesh.services.router.request import RouterRequest
from kvmesh.v1 import worker_pb2

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
