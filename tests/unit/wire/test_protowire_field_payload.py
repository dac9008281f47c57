"""`field_payload`: a top-level field's wire bytes, as the router forwards a client's token-id prompt."""

from __future__ import annotations

import pytest

from kvmesh.v1 import common_pb2, router_pb2
from kvmesh.wire.protowire import field_payload, length_delimited, varint

pytestmark = pytest.mark.unit

_IDS = router_pb2.RouterServiceGenerateRequest.DESCRIPTOR.fields_by_name["token_ids"].number


@pytest.mark.parametrize("n", [1, 127, 128, 8192])
def test_payload_is_the_token_ids_message_among_other_fields(n: int) -> None:
    ids = [(i * 7919) % 150000 for i in range(n)]
    req = router_pb2.RouterServiceGenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=common_pb2.SamplingParams(max_tokens=9, temperature=0.5, seed=2**40),
        session_id="s-1",
        request_id="r-1",
        resume_token_ids=[1, 2, 3],
    )
    got = field_payload(req.SerializeToString(), _IDS)
    assert got is not None
    assert list(common_pb2.TokenIds.FromString(got).ids) == ids


def test_repeated_occurrences_concatenate_as_a_parser_merges_them() -> None:
    a = common_pb2.TokenIds(ids=[1, 2]).SerializeToString()
    b = common_pb2.TokenIds(ids=[300, 4]).SerializeToString()
    wire = length_delimited(_IDS, a) + router_pb2.RouterServiceGenerateRequest(session_id="x").SerializeToString()
    wire += length_delimited(_IDS, b)
    got = field_payload(wire, _IDS)
    assert got is not None
    parsed = router_pb2.RouterServiceGenerateRequest.FromString(wire)
    assert list(common_pb2.TokenIds.FromString(got).ids) == list(parsed.token_ids.ids) == [1, 2, 300, 4]


def test_absent_field_and_unwalkable_input_give_none() -> None:
    text_only = router_pb2.RouterServiceGenerateRequest(text="hello").SerializeToString()
    assert field_payload(text_only, _IDS) is None
    assert field_payload(b"", _IDS) is None
    truncated = length_delimited(_IDS, b"\x08\x01\x08\x02")[:-1]
    assert field_payload(truncated, _IDS) is None
    group = varint((_IDS << 3) | 3) + varint((_IDS << 3) | 4)  # deprecated group wire types: not walked
    assert field_payload(group, _IDS) is None
    assert field_payload(b"\xff" * 11, _IDS) is None  # a varint that never ends


def test_a_oneof_sibling_on_the_wire_gives_none() -> None:
    """token_ids, then text, then token_ids again parses to the last token_ids only: the scanner must not
    concatenate both, so it declines and the router serialises the parsed prompt instead."""
    siblings = frozenset(
        f.number
        for f in router_pb2.RouterServiceGenerateRequest.DESCRIPTOR.oneofs_by_name["prompt"].fields
        if f.number != _IDS
    )
    first = length_delimited(_IDS, common_pb2.TokenIds(ids=[1, 2]).SerializeToString())
    text = router_pb2.RouterServiceGenerateRequest(text="hi").SerializeToString()
    last = length_delimited(_IDS, common_pb2.TokenIds(ids=[3]).SerializeToString())
    wire = first + text + last
    assert list(router_pb2.RouterServiceGenerateRequest.FromString(wire).token_ids.ids) == [3]
    assert field_payload(wire, _IDS, siblings) is None
    assert field_payload(first + last, _IDS, siblings) is not None
