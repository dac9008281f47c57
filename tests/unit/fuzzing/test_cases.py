"""The fuzzer's case generators (`kvmesh.fuzzing`): each kind of protobuf encoding is what it claims to be."""

from __future__ import annotations

import pytest
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.fuzzing.http import HttpRoute, http_cases
from kvmesh.fuzzing.proto import bad_utf8, grpc_cases, messages, methods_of, with_unknown_fields
from kvmesh.v1 import cache_manager_pb2, failover_pb2, kvsync_pb2, router_pb2, worker_pb2

pytestmark = pytest.mark.unit
FAST = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
INPUTS = sorted(
    {
        m.input_type
        for mod in (cache_manager_pb2, failover_pb2, kvsync_pb2, router_pb2, worker_pb2)
        for s in mod.DESCRIPTOR.services_by_name.values()
        for m in s.methods
    },
    key=lambda d: d.full_name,
)
WITH_STRINGS = [d for d in INPUTS if any(f.type == f.TYPE_STRING for f in d.fields)]


def parse(desc, raw: bytes):  # type: ignore[no-untyped-def]
    return message_factory.GetMessageClass(desc).FromString(raw)


def test_methods_of_lists_every_rpc_with_its_streaming_kind() -> None:
    methods = {m.path: m for m in methods_of(cache_manager_pb2.DESCRIPTOR.services_by_name["CacheManagerService"])}
    assert len(methods) == 10
    publish = methods["/kvmesh.v1.CacheManagerService/PublishKvEvents"]
    assert publish.client_streaming and publish.server_streaming and publish.service == "kvmesh.v1.CacheManagerService"
    assert not methods["/kvmesh.v1.CacheManagerService/FindMatches"].server_streaming


@FAST
@given(st.sampled_from(INPUTS).flatmap(lambda d: st.tuples(st.just(d), messages(d))))
def test_valid_messages_round_trip(drawn) -> None:  # type: ignore[no-untyped-def]
    desc, msg = drawn
    raw = msg.SerializeToString()
    assert parse(desc, raw).SerializeToString(deterministic=True) == msg.SerializeToString(deterministic=True)


@FAST
@given(st.sampled_from(INPUTS).flatmap(lambda d: st.tuples(st.just(d), with_unknown_fields(d))))
def test_unknown_fields_decode_and_are_unknown(drawn) -> None:  # type: ignore[no-untyped-def]
    desc, raw = drawn
    msg = parse(desc, raw)
    before = len(msg.SerializeToString())
    msg.DiscardUnknownFields()
    assert len(msg.SerializeToString()) < before


@FAST
@given(st.sampled_from(WITH_STRINGS).flatmap(lambda d: st.tuples(st.just(d), bad_utf8(d))))
def test_bad_utf8_does_not_decode(drawn) -> None:  # type: ignore[no-untyped-def]
    desc, raw = drawn
    with pytest.raises(DecodeError):
        parse(desc, raw)


@FAST
@given(grpc_cases(methods_of(worker_pb2.DESCRIPTOR.services_by_name["WorkerService"])))
def test_request_streams_send_one_to_four_messages(case) -> None:  # type: ignore[no-untyped-def]
    assert 1 <= len(case.messages) <= (4 if case.method.client_streaming else 1)
    assert len(case.kinds) == len(case.messages)


@FAST
@given(http_cases([HttpRoute("POST", "/v1/completions", "completion")]))
def test_http_cases_are_raw_bytes_or_a_request(case) -> None:  # type: ignore[no-untyped-def]
    if case.raw:
        assert case.kind == "raw"
    else:
        assert case.method and case.path.startswith("/")
        for _name, value in case.headers:
            assert "\r" not in value and "\n" not in value
            value.encode("latin-1")
