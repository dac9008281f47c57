"""The router's worker-request helpers: `worker_request_bytes` / `attempt_request_bytes` (pre-serialised worker
requests parse to the GenerateRequest they stand for) and `classify` (worker status codes -> attempt failures)."""

from __future__ import annotations

from typing import cast

import grpc
import pytest

from kvmesh.routing.attempts import Failure, NextAttempt
from kvmesh.services.router.stream_requests import rpc_error
from kvmesh.services.router.worker_stream import WorkerCall, attempt_request_bytes, classify, worker_request_bytes
from kvmesh.v1 import common_pb2, worker_pb2

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("n", [0, 1, 127, 128, 8192, 102400])
@pytest.mark.parametrize("generated", [[], [5, 6, 70000]])
def test_parses_to_head_plus_prompt_plus_generated(n: int, generated: list[int]) -> None:
    head = worker_pb2.GenerateRequest(
        request_id="r1", tenant="acme", detokenize=True, sampling=common_pb2.SamplingParams(max_tokens=7, seed=3)
    )
    ids = [(i * 7919) % 150000 for i in range(n)]
    wire = common_pb2.TokenIds(ids=ids).SerializeToString()
    if generated:
        wire += common_pb2.TokenIds(ids=generated).SerializeToString()
    got = worker_pb2.GenerateRequest.FromString(worker_request_bytes(head, wire))
    want = worker_pb2.GenerateRequest()
    want.CopyFrom(head)
    want.token_ids.ids.extend(ids + generated)
    assert got == want


@pytest.mark.parametrize("so_far", [[], [9, 10]])
def test_attempt_request_bytes_adjust_sampling_and_append_the_tokens_so_far(so_far: list[int]) -> None:
    sampling = common_pb2.SamplingParams(max_tokens=50, min_tokens=8, seed=3, temperature=0.5)
    head = worker_pb2.GenerateRequest(request_id="r1", tenant="acme", lora_name="lo", detokenize=True)
    prompt = common_pb2.TokenIds(ids=[1, 2, 3]).SerializeToString()
    got = worker_pb2.GenerateRequest.FromString(
        attempt_request_bytes(head, sampling, NextAttempt(48, 6), prompt, so_far)
    )
    assert list(got.token_ids.ids) == [1, 2, 3, *so_far]
    assert (got.sampling.max_tokens, got.sampling.min_tokens) == (48, 6)
    assert (got.sampling.seed, got.sampling.temperature) == (3, 0.5)
    assert (got.request_id, got.tenant, got.lora_name, got.detokenize) == ("r1", "acme", "lo", True)
    assert sampling.max_tokens == 50  # the request's own sampling is left as it was


class _Call:
    def __init__(self, cancelled: bool) -> None:
        self._cancelled = cancelled

    def cancelled(self) -> bool:
        return self._cancelled


@pytest.mark.parametrize(
    ("code", "cancelled", "want"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, False, Failure.CLIENT_ERROR),
        (grpc.StatusCode.OUT_OF_RANGE, False, Failure.CLIENT_ERROR),
        (grpc.StatusCode.FAILED_PRECONDITION, False, Failure.CLIENT_ERROR),
        (grpc.StatusCode.CANCELLED, True, Failure.CANCELLED),
        (grpc.StatusCode.CANCELLED, False, Failure.WORKER),  # the worker cancelled (shutting down)
        (grpc.StatusCode.RESOURCE_EXHAUSTED, False, Failure.RESOURCE_EXHAUSTED),
        (grpc.StatusCode.UNAVAILABLE, False, Failure.WORKER),
        (grpc.StatusCode.INTERNAL, False, Failure.WORKER),
    ],
)
def test_classify_worker_errors(code: grpc.StatusCode, cancelled: bool, want: Failure) -> None:
    call = cast(WorkerCall, _Call(cancelled))
    assert classify(rpc_error(code, "x"), call) is want
