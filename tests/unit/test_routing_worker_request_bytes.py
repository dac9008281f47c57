"""`worker_request_bytes`: the router's pre-serialised worker request parses to the same GenerateRequest."""

from __future__ import annotations

import pytest

from kvmesh.services.router.core import worker_request_bytes
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
