"""The input-hardening work's input checks that need no process: token ids against the vocabulary, text sizes before
tokenising, resumed tokens not counted as generated, undecodable gRPC requests, quiet aiohttp logs."""

from __future__ import annotations

import logging

import pytest
from aiohttp.http_exceptions import BadHttpMessage

from kvmesh.core.errors import InvalidArgument
from kvmesh.openai.protocol import Message
from kvmesh.routing import attempts as at
from kvmesh.rpc.interceptors import MessageBounds, RefusedRequest, safe_deserializer
from kvmesh.rpc.server import QuietClientErrors
from kvmesh.services.router.limits import check_chat_size, check_text_size, check_token_ids
from kvmesh.v1 import common_pb2, router_pb2

pytestmark = pytest.mark.unit


def test_token_ids_within_the_vocabulary() -> None:
    check_token_ids([0, 5, 99], 100, "prompt")
    check_token_ids([], 100, "prompt")
    check_token_ids([2**40], 0, "prompt")  # 0: no vocabulary bound
    for ids in ([5, 100], [-1], [2**40]):
        with pytest.raises(InvalidArgument) as ei:
            check_token_ids(ids, 100, "resume_token_ids")
        assert ei.value.field == "resume_token_ids" and "[0, 100)" in ei.value.message


def test_token_ids_from_the_wire() -> None:
    """A protobuf repeated field (checked through its buffer, not as a list) gets the same verdicts."""
    check_token_ids(common_pb2.TokenIds(ids=[0, 5, 99]).ids, 100, "prompt")
    check_token_ids(common_pb2.TokenIds().ids, 100, "prompt")
    with pytest.raises(InvalidArgument) as ei:
        check_token_ids(common_pb2.TokenIds(ids=[3, 100, 4]).ids, 100, "prompt")
    assert ei.value.field == "prompt" and "[0, 100)" in ei.value.message


def test_text_and_chat_sizes() -> None:
    check_text_size("x" * 10, 10, "prompt")
    check_text_size("x" * 10**6, 0, "prompt")  # 0: unchecked
    with pytest.raises(InvalidArgument) as ei:
        check_text_size("x" * 11, 10, "prompt")
    assert ei.value.field == "prompt"
    check_chat_size([Message("user", "x" * 6)], 2, 10)
    with pytest.raises(InvalidArgument, match="3 messages"):
        check_chat_size([Message("user", "a")] * 3, 2, 100)
    with pytest.raises(InvalidArgument) as ei:
        check_chat_size([Message("user", "x" * 4), Message("assistant", "y")], 2, 10)
    assert ei.value.field == "messages"
    with pytest.raises(InvalidArgument):  # a past call's arguments and the tools count too
        check_chat_size([Message("assistant", "", tool_calls=(("c", "f", '{"a": 1}'),))], 2, 10)
    with pytest.raises(InvalidArgument):
        check_chat_size([Message("user", "x")], 2, 10, extra_chars=9)


def test_resumed_tokens_are_not_generated() -> None:
    a = at.Attempts("r", at.Limits(3, 3, 10), resume_ids=[7] * 4)
    plan = a.next_attempt(0)
    assert isinstance(plan, at.NextAttempt) and plan.max_tokens == 6
    assert a.n_generated == 0
    a.add([1, 2])
    assert a.n_generated == 2 and len(a.tokens) == 6


def test_undecodable_request_bytes() -> None:
    decode = safe_deserializer(router_pb2.RouterServiceGenerateRequest.FromString)
    assert decode is not None and safe_deserializer(None) is None
    bad = decode(b"\xff\xff\xff")
    assert isinstance(bad, RefusedRequest) and "DecodeError" in bad.error
    with pytest.raises(InvalidArgument) as ei:
        bad.raise_invalid()
    assert ei.value.field == "request"
    ok = router_pb2.RouterServiceGenerateRequest(text="hi")
    assert decode(ok.SerializeToString()) == ok


def test_request_over_the_method_bound_is_refused_undecoded() -> None:
    calls: list[bytes] = []

    def parse(raw: bytes) -> router_pb2.RouterServiceGenerateRequest:
        calls.append(raw)
        return router_pb2.RouterServiceGenerateRequest.FromString(raw)

    decode = safe_deserializer(parse, max_bytes=10)
    assert decode is not None
    at_bound = router_pb2.RouterServiceGenerateRequest(text="a" * 8).SerializeToString()
    assert len(at_bound) == 10 and decode(at_bound).text == "a" * 8
    over = decode(router_pb2.RouterServiceGenerateRequest(text="a" * 9).SerializeToString())
    assert isinstance(over, RefusedRequest) and "11 bytes" in over.error and "at most 10" in over.error
    assert calls == [at_bound]  # the oversize bytes never reached the parser


def test_message_bounds_per_method() -> None:
    b = MessageBounds(100, {"/kvmesh.v1.RouterService/Generate": 5000})
    assert b.of("/kvmesh.v1.RouterService/Generate") == 5000 and b.of("/kvmesh.v1.RouterAdminService/Rebalance") == 100
    assert b.largest == 5000 and MessageBounds().largest is None and MessageBounds().of("/x/y") is None


def test_aiohttp_client_errors_logged_as_info_without_traceback() -> None:
    def record(exc: BaseException) -> logging.LogRecord:
        return logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request from %s",
                                 ("127.0.0.1",), (type(exc), exc, None))  # fmt: skip

    quiet = QuietClientErrors()
    for exc in (BadHttpMessage("Invalid character in Content-Length:\n  x"), ConnectionResetError("gone")):
        r = record(exc)
        assert quiet.filter(r)
        assert r.levelno == logging.INFO and r.exc_info is None
        assert "\n" not in r.getMessage() and type(exc).__name__ in r.getMessage()
    other = record(RuntimeError("bug"))
    assert quiet.filter(other) and other.levelno == logging.ERROR and other.exc_info is not None
