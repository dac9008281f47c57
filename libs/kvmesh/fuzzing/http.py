"""HTTP requests for kvmesh's routes (pure `hypothesis` strategies): plausible bodies (which pass
validation); bodies shaped like the OpenAI request schemas (`kvmesh.openai.protocol`) and the admin bodies,
each field with a value of its type, of a wrong type, huge or missing, unknown fields added; non-JSON bodies
(random bytes, invalid UTF-8, truncated or deeply nested JSON, NaN / 1e999 literals); every content type;
odd headers (bearer tokens, session ids, header values in Latin-1 with NUL and controls); unknown paths and
wrong methods; raw bytes on the port.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from kvmesh.fuzzing.proto import huge_text, texts

Json = Any
BIG_INTS = (2**31, 2**32, 2**63, 2**64, 10**30, -(2**63) - 1)


@dataclass(frozen=True)
class HttpRoute:
    """One route: method, path and the body schema its POST takes (`SCHEMAS` key; "" for none)."""

    method: str
    path: str
    schema: str = ""


@dataclass(frozen=True)
class HttpCase:
    """One request: `raw` set means these bytes are written to the port as they are."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    kind: str
    raw: bytes = b""


@functools.cache
def json_values(max_leaves: int = 8) -> st.SearchStrategy[Json]:
    """Any JSON value (of wrong type, mostly), nested a little."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.sampled_from(BIG_INTS),
        st.floats(allow_nan=False, allow_infinity=False),
        texts(big=False),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=max_leaves,
    )


@functools.cache
def _number() -> st.SearchStrategy[Json]:
    return st.one_of(st.integers(-5, 5), st.floats(-10, 10), st.sampled_from(BIG_INTS), st.integers(-(2**70), 2**70))


@functools.cache
def _count() -> st.SearchStrategy[Json]:
    return st.one_of(st.integers(-2, 64), st.sampled_from([0, 2**31, 2**63, -1]), st.integers(-(2**64), 2**64))


@functools.cache
def _prompt() -> st.SearchStrategy[Json]:
    ids = st.lists(st.one_of(st.integers(0, 1100), st.integers(-(2**40), 2**40), st.booleans()), max_size=64)
    long_ids = st.builds(lambda v, n: [v] * n, st.integers(0, 1000), st.integers(1000, 200_000))
    return st.one_of(texts(), ids, long_ids, st.lists(st.one_of(texts(big=False), ids), max_size=3))


@functools.cache
def _messages() -> st.SearchStrategy[Json]:
    role = st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), json_values(2))
    part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": texts(big=False)})
    content = st.one_of(texts(), st.lists(st.one_of(part, json_values(2)), max_size=3), json_values(2))
    message = st.one_of(
        st.fixed_dictionaries({"role": role, "content": content}, optional={"name": texts(big=False)}),
        json_values(3),
    )
    many = st.builds(lambda m, n: [m] * n, message, st.integers(100, 20_000))
    return st.one_of(st.lists(message, max_size=5), many)


def _common() -> dict[str, st.SearchStrategy[Json]]:
    text = texts(big=False)
    return {
        "model": st.one_of(text, st.just("")),
        "max_tokens": _count(),
        "min_tokens": _count(),
        "temperature": _number(),
        "top_p": _number(),
        "top_k": _count(),
        "seed": st.one_of(_count(), st.sampled_from([2**63 - 1, 2**63, 2**64 - 1])),
        "stop": st.one_of(text, st.lists(text, max_size=5), huge_text()),
        "stop_token_ids": st.lists(_count(), max_size=5),
        "ignore_eos": st.booleans(),
        "presence_penalty": _number(),
        "frequency_penalty": _number(),
        "repetition_penalty": _number(),
        "stream": st.booleans(),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values(2)),
        "user": text,
        "session_id": text,
        "n": st.sampled_from([1, 2, 0]),
        "logprobs": st.sampled_from([False, 0, True, 5]),
        "logit_bias": st.one_of(st.just({}), json_values(2)),
    }


@functools.cache
def schemas() -> dict[str, dict[str, st.SearchStrategy[Json]]]:
    """Field name -> well-typed values, per body schema."""
    return {
        "completion": {**_common(), "prompt": _prompt(), "echo": st.booleans(), "suffix": texts(big=False)},
        "chat": {**_common(), "messages": _messages(), "max_completion_tokens": _count()},
        "rebalance": {"prefill_weight": _number(), "decode_weight": _number()},
        "drain": {"worker_id": texts(), "drain": st.one_of(st.booleans(), st.sampled_from(["false", "true", 0, 1]))},
    }


@functools.cache
def shaped_bodies(schema: str) -> st.SearchStrategy[Json]:
    """A JSON object of `schema`: any subset of its fields, some with a wrong-typed value, maybe unknown
    fields too."""
    fields = schemas().get(schema, {})
    wrong = json_values()
    optional = {name: st.one_of(good, good, wrong) for name, good in fields.items()}
    unknown = st.dictionaries(st.text(min_size=1, max_size=12), json_values(3), max_size=3)
    return st.builds(lambda known, extra: {**extra, **known}, st.fixed_dictionaries({}, optional=optional), unknown)


def _dumps(value: Json) -> bytes:
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


@functools.cache
def plausible_bodies(schema: str) -> st.SearchStrategy[Json]:
    """Bodies a well-meaning client sends (short prompts, a few tokens, sane sampling): they pass validation,
    so the fuzzer reaches generation, streaming and the admin actions too."""
    words = st.sampled_from(["hello", "world", "kv", "mesh", " ", "the", "é"])
    text = st.lists(words, min_size=1, max_size=12).map("".join)
    sane: dict[str, st.SearchStrategy[Json]] = {
        "max_tokens": st.integers(1, 8),
        "temperature": st.sampled_from([0.0, 0.7, 1.0]),
        "top_p": st.sampled_from([0.5, 1.0]),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "ignore_eos": st.booleans(),
        "stop": st.lists(words, max_size=2),
        "user": st.sampled_from(["u1", "u2"]),
    }
    by_schema: dict[str, dict[str, st.SearchStrategy[Json]]] = {
        "completion": {"prompt": st.one_of(text, st.lists(st.integers(3, 1000), min_size=1, max_size=64))},
        "chat": {
            "messages": st.lists(
                st.fixed_dictionaries({"role": st.just("user"), "content": text}), min_size=1, max_size=3
            )
        },
        "rebalance": {"prefill_weight": st.floats(0, 1), "decode_weight": st.floats(0, 1)},
        "drain": {"worker_id": st.sampled_from(["worker-0", "nope"]), "drain": st.just(False)},
    }
    required = by_schema.get(schema, {})
    optional = sane if schema in ("completion", "chat") else {}
    return st.fixed_dictionaries(required, optional=optional)


@functools.cache
def non_json_bodies() -> st.SearchStrategy[bytes]:
    """Bodies a JSON parser refuses (or accepts oddly)."""
    fixed = [b"", b"null", b"[]", b'"x"', b"1e999999", b'{"max_tokens": NaN}', b'{"a": Infinity}', b"{", b"\xff\xfe"]
    fixed += [b'{"prompt": "\\ud800"}', b"{}" * 3, b'{"a":1,"a":2}', b"\x00", b'{"stream": true']
    deep = st.integers(100, 100_000).map(lambda n: b"[" * n + b"]" * n)
    deep_obj = st.integers(100, 50_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n)
    return st.one_of(st.sampled_from(fixed), st.binary(max_size=200), deep, deep_obj)


_CONTENT_TYPES = (
    "application/json",
    "application/json; charset=utf-8",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=latin-1",
    "",
    "*/*",
    "application/octet-stream",
)


@functools.cache
def header_values() -> st.SearchStrategy[str]:
    """Latin-1 header values, NUL and controls included (no CR or LF: those would end the header)."""
    latin1 = st.characters(min_codepoint=0, max_codepoint=255, exclude_characters="\r\n")
    return st.one_of(st.text(latin1, max_size=40), st.sampled_from(["Bearer ", "Bearer x", "bearer", "Basic eA=="]))


@functools.cache
def headers() -> st.SearchStrategy[dict[str, str]]:
    """Request headers: content type, auth, session id, odd extra ones."""
    token = st.from_regex(r"\A[A-Za-z0-9!#$%&'*+.^_`|~-]{1,20}\Z")
    optional = {
        "Content-Type": st.one_of(st.sampled_from(_CONTENT_TYPES), header_values()),
        "Authorization": header_values(),
        "X-Api-Key": header_values(),
        "X-Session-Id": st.one_of(header_values(), huge_text().map(lambda s: s.encode().hex()[:6000])),
        "Accept": st.sampled_from(["text/event-stream", "*/*", "application/json", "x"]),
        "Accept-Encoding": st.sampled_from(["gzip", "br", "identity", "x;q=abc"]),
        "X-Request-Id": header_values(),
        "traceparent": header_values(),
    }
    extra = st.dictionaries(token, header_values(), max_size=3)
    return st.builds(lambda known, more: {**more, **known}, st.fixed_dictionaries({}, optional=optional), extra)


@functools.cache
def raw_requests() -> st.SearchStrategy[bytes]:
    """Bytes on the HTTP port: random, or a request line / headers broken in one place."""
    fixed = [
        b"GET /healthz HTTP/9.9\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
        b"GET " + b"/a" * 10_000 + b" HTTP/1.1\r\n\r\n",
        b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 500 + b"\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # a TLS ClientHello start
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",  # an HTTP/2 preface
    ]
    return st.one_of(st.sampled_from(fixed), st.binary(min_size=1, max_size=300))


@functools.cache
def _path(route: HttpRoute) -> st.SearchStrategy[str]:
    query = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="#"), max_size=20)
    odd = st.sampled_from(["/", "/v1", "/v1/completions/x", "/admin", "/%00", "/..%2f..%2fetc", "/v1//models"])
    return st.one_of(st.just(route.path), st.builds(lambda q: f"{route.path}?{q}", query), odd)


_KINDS = st.sampled_from(["plausible", "shaped", "shaped", "any-json", "non-json", "raw"])
_METHODS = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"])
_BOOLS = st.booleans()


def http_cases(routes: list[HttpRoute]) -> st.SearchStrategy[HttpCase]:
    """A request to one of `routes` (or near it)."""

    def case(route: HttpRoute, data: st.DataObject) -> HttpCase:
        kind = data.draw(_KINDS)
        if kind == "raw":
            return HttpCase("", route.path, (), b"", kind, raw=data.draw(raw_requests()))
        if kind == "plausible":
            body = _dumps(data.draw(plausible_bodies(route.schema or "completion")))
        elif kind == "shaped":
            body = _dumps(data.draw(shaped_bodies(route.schema or "completion")))
        elif kind == "any-json":
            body = _dumps(data.draw(json_values()))
        else:
            body = data.draw(non_json_bodies())
        method = route.method if data.draw(_BOOLS) else data.draw(_METHODS)
        if method in ("GET", "DELETE") and data.draw(_BOOLS):
            body = b""
        hdrs = data.draw(headers())
        if "Content-Type" not in hdrs and data.draw(_BOOLS):
            hdrs["Content-Type"] = "application/json"
        return HttpCase(method, data.draw(_path(route)), tuple(hdrs.items()), body, kind)

    return st.builds(case, st.sampled_from(routes), st.data())
