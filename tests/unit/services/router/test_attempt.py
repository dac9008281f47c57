"""An attempt's worker request (`worker_request`): the domain request becomes the `GenerateRequest` a worker
parses, with the attempt's sampling budget, the prompt's wire bytes followed by the tokens so far, and the pull
pull placement chose; `Attempt.send` and `Attempt.take`."""

from __future__ import annotations

from typing import cast

import pytest

from kvmesh.core.generation import SamplingParams
from kvmesh.core.handoff import KvHandoff
from kvmesh.core.pull import KvPull
from kvmesh.routing.attempts import NextAttempt
from kvmesh.routing.stall import StallConfig, WorkerLatency
from kvmesh.services.router.attempt import Attempt, worker_request
from kvmesh.services.router.limits import CoreLimits
from kvmesh.services.router.request import RouterRequest
from kvmesh.services.router.stall_watch import StallWatch
from kvmesh.services.router.workers import WorkerHandle
from kvmesh.v1 import worker_pb2

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("so_far", [[], [9, 10]])
def test_the_worker_request_carries_the_attempt(so_far: list[int]) -> None:
    sampling = SamplingParams(max_tokens=50, min_tokens=8, seed=3, temperature=0.5, stop_token_ids=(2,), stop=("x",))
    req = RouterRequest.checked(CoreLimits(), "r1", [1, 2, 3], sampling, tenant="acme", lora="lo")
    pull = KvPull(source_address="10.0.0.9:7", source_worker_id="w9", num_blocks=2)
    got = worker_pb2.GenerateRequest.FromString(worker_request("r1", req, NextAttempt(48, 6), so_far, pull))
    assert list(got.token_ids.ids) == [1, 2, 3, *so_far]
    assert got.resumed_output_tokens == len(so_far)  # the worker's grammar, if any, starts after them
    assert (got.sampling.max_tokens, got.sampling.min_tokens) == (48, 6)
    assert (got.sampling.seed, got.sampling.temperature) == (3, 0.5)
    assert (list(got.sampling.stop_token_ids), list(got.sampling.stop)) == ([2], ["x"])
    assert (got.request_id, got.tenant, got.lora_name, got.detokenize) == ("r1", "acme", "lo", True)
    assert (got.kv_pull.source_address, got.kv_pull.source_worker_id, got.kv_pull.num_blocks) == ("10.0.0.9:7", "w9", 2)
    no_hint = worker_pb2.GenerateRequest.FromString(worker_request("r1", req, NextAttempt(48, 6), so_far, None))
    assert not no_hint.HasField("kv_pull")


class Handle:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, dict[str, str]]] = []

    async def generate(self, rid: str, request: bytes, carrier: dict[str, str], sequences: int = 1) -> str:
        self.sent.append((rid, request, carrier))
        return f"call-{len(self.sent)}"


def attempt(wid: str, h: Handle) -> Attempt:
    watch = StallWatch(StallConfig(), WorkerLatency(), 4, lambda: 0.0, lambda: True)
    return Attempt("r1", wid, cast(WorkerHandle, h), b"req-" + wid.encode(), 4, 8, watch)


async def test_send_and_take() -> None:
    h0, h1 = Handle(), Handle()
    a, b = attempt("w0", h0), attempt("w1", h1)
    await a.send({"traceparent": "t"})
    assert h0.sent == [("r1", b"req-w0", {"traceparent": "t"})] and a.call == "call-1"
    b.hedge = True
    a.take(b)  # a hedge that won: the attempt is the hedge's from here on
    assert (a.wid, a.h, a.request, a.hedge, a.call, a.watch) == ("w1", h1, b"req-w1", True, None, b.watch)


def test_a_decode_half_carries_its_handoff_by_the_transfer_both_workers_have() -> None:
    """A kv-sync handoff becomes the decode half's `kv_pull`; an engine handoff (vLLM's kv_transfer_params)
    goes as is to a decode worker that has the engine's transfer, and as the kv-sync pull to one that lacks it."""
    req = RouterRequest.checked(CoreLimits(), "r1", list(range(3, 100)), SamplingParams(max_tokens=5))
    pull = KvPull(source_address="10.0.0.9:7", source_worker_id="p0", num_blocks=3, expires_unix_ms=99)
    kvsync = KvHandoff(num_blocks=3, held_until_unix_ms=99, source_worker_id="p0", pull=pull, cached_tokens=32)
    got = worker_pb2.GenerateRequest.FromString(worker_request("r1", req, NextAttempt(5, 0), [], None, kvsync))
    assert (got.kv_pull.source_address, got.kv_pull.num_blocks) == ("10.0.0.9:7", 3)
    assert got.handoff.source_worker_id == "p0" and not got.handoff.engine_params_json
    both = KvHandoff(num_blocks=3, source_worker_id="p0", pull=pull, engine_params_json='{"remote_engine_id": "e"}')
    native = worker_pb2.GenerateRequest.FromString(
        worker_request("r1", req, NextAttempt(5, 0), [], None, both, engine_handoff=True)
    )
    assert native.handoff.engine_params_json == '{"remote_engine_id": "e"}' and not native.HasField("kv_pull")
    fallback = worker_pb2.GenerateRequest.FromString(
        worker_request("r1", req, NextAttempt(5, 0), [], None, both, engine_handoff=False)
    )
    assert fallback.kv_pull.num_blocks == 3 and not fallback.handoff.engine_params_json
