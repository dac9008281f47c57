"""The router benchmark's prompts: every request a new block-hash chain, the tail shared, wire bytes valid."""

from __future__ import annotations

import pytest

from kvmesh.bench.router_service import UNIQUE_BASE, UniquePrompts
from kvmesh.index import hashing
from kvmesh.v1 import common_pb2, router_pb2
from kvmesh.wire.protowire import length_delimited

pytestmark = pytest.mark.unit


def test_each_request_is_a_new_chain_over_a_shared_tail() -> None:
    bases = [[3 + (i * 7 + j) % 1000 for j in range(96)] for i in range(3)]
    up = UniquePrompts(bases)
    seen = set()
    for k in range(9):
        ids = list(common_pb2.TokenIds.FromString(up.token_ids_bytes()).ids)
        assert ids[0] == UNIQUE_BASE + k and ids[1:] == bases[k % 3][1:]
        first_block = hashing.compute_block_hashes(ids, 32, 0)[0]
        assert first_block not in seen  # a new chain: no prefix-cache hit for any block
        seen.add(int(first_block))


def test_router_request_bytes_parse_to_the_prompt() -> None:
    up = UniquePrompts([[5, 6, 7, 8]])
    sp = common_pb2.SamplingParams(max_tokens=1, ignore_eos=True)
    field = router_pb2.RouterServiceGenerateRequest.DESCRIPTOR.fields_by_name["token_ids"].number
    tail = router_pb2.RouterServiceGenerateRequest(sampling=sp).SerializeToString()
    body = length_delimited(field, up.token_ids_bytes()) + tail
    r = router_pb2.RouterServiceGenerateRequest.FromString(body)
    assert r.WhichOneof("prompt") == "token_ids" and list(r.token_ids.ids) == [UNIQUE_BASE, 6, 7, 8]
    assert r.sampling.max_tokens == 1 and r.sampling.ignore_eos
