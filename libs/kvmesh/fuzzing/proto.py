"""Protobuf request messages as wire bytes, derived from descriptors (pure `hypothesis` strategies).

For a method's input message, `encodings(desc)` draws one of:
- `plausible`: small, sane values only (numbers 0-64, short known-looking strings, known enum values), so
  that many pass validation and the fuzzer reaches the code behind it;
- `valid`: a message built field by field from the descriptor: integers over their type's whole range with
  the extremes (0, ±1, min, max) likely, floats with NaN/±inf, strings empty, huge (up to ~1 MB), with NUL,
  bidi controls and astral-plane characters, repeated fields empty, short or long (up to 20,000 items),
  nested messages to `MAX_DEPTH`, maps, enum values known and unknown;
- `unknown-fields`: a valid message followed by fields of numbers the message does not declare, of every
  wire type (groups included);
- `wrong-wire-type`: a declared field sent with a wire type other than its own;
- `truncated`: a valid encoding cut short (inside a tag, a varint or a length-delimited payload);
- `bad-utf8`: a string field whose bytes are not UTF-8;
- `malformed`: random bytes, an 11-byte varint, field number 0, wire types 6 and 7, a length past the end.

Wire keys are `(number << 3) | wire_type` (wire types: 0 varint, 1 fixed64, 2 length-delimited, 3/4 group
start/end, 5 fixed32).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

from kvmesh.wire.protowire import length_delimited, varint

MAX_DEPTH = 3  # nested messages below this depth are left empty
MAX_LONG_REPEATED = 20_000
MAX_LONG_MESSAGES = 2_000
MAX_HUGE_REPEAT = 250_000  # a huge string is a short one repeated up to this many times (<= ~1 MB of UTF-8)
FIELD_NUMBER_MAX = 2**29 - 1
MAX_MESSAGE_BYTES = 8 << 20  # a drawn message larger than this is drawn again
RESERVED = range(19_000, 20_000)  # field numbers protobuf reserves for itself

FD = FieldDescriptor
_RANGES: dict[int, tuple[int, int]] = {
    FD.TYPE_INT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FD.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FD.TYPE_INT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FD.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FD.TYPE_UINT32: (0, 2**32 - 1),
    FD.TYPE_FIXED32: (0, 2**32 - 1),
    FD.TYPE_UINT64: (0, 2**64 - 1),
    FD.TYPE_FIXED64: (0, 2**64 - 1),
}
_FIXED64 = {FD.TYPE_FIXED64, FD.TYPE_SFIXED64, FD.TYPE_DOUBLE}
_FIXED32 = {FD.TYPE_FIXED32, FD.TYPE_SFIXED32, FD.TYPE_FLOAT}
_DELIMITED = {FD.TYPE_STRING, FD.TYPE_BYTES, FD.TYPE_MESSAGE}
ODD_STRINGS: tuple[str, ...] = (
    "",
    "\x00",
    "a\x00b",
    "\u202e\u2066",
    "🙂" * 3,
    "\ufeff",
    "é" * 7,
    " ",
    "..",
    "../../etc/passwd",
)
ODD_STRINGS += ("127.0.0.1:1", "[::1]:0", "-1", "NaN", "%s%n", "\\", "'\"", "worker-local-0", "*")


@dataclass(frozen=True)
class RpcMethod:
    """One RPC: its path (`/kvmesh.v1.WorkerService/Generate`), input message and streaming kind."""

    path: str
    input: Descriptor
    client_streaming: bool
    server_streaming: bool

    @property
    def service(self) -> str:
        return self.path.split("/")[1]

    @classmethod
    def of(cls, m: MethodDescriptor) -> RpcMethod:
        return cls(f"/{m.containing_service.full_name}/{m.name}", m.input_type, m.client_streaming, m.server_streaming)


def methods_of(service: ServiceDescriptor) -> list[RpcMethod]:
    """Every method of `service`."""
    return [RpcMethod.of(m) for m in service.methods]


def wire_type(fd: FieldDescriptor) -> int:
    """The wire type a field is encoded with (repeated scalars: length-delimited when packed)."""
    if fd.type in _DELIMITED or (_is_repeated(fd) and fd.is_packed):
        return 2
    if fd.type == FD.TYPE_GROUP:
        return 3
    return 1 if fd.type in _FIXED64 else 5 if fd.type in _FIXED32 else 0


def _is_repeated(fd: FieldDescriptor) -> bool:
    return bool(fd.is_repeated)


def _message_type(fd: FieldDescriptor) -> Descriptor:
    assert fd.message_type is not None, fd.full_name
    return fd.message_type


def _with_extremes(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Integers in [lo, hi]: the edges of the range and of the narrower integer types, small ones, any."""
    edges = sorted({e for e in (lo, lo + 1, -1, 0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, hi - 1, hi) if lo <= e <= hi})
    return st.one_of(st.sampled_from(edges), st.integers(0, 300), st.integers(lo, hi))


@functools.cache
def huge_text() -> st.SearchStrategy[str]:
    """A short text repeated into a huge one (cheap to draw; up to `MAX_HUGE_REPEAT` copies)."""
    return st.builds(lambda s, n: s * n, st.text(min_size=1, max_size=4), st.integers(1_000, MAX_HUGE_REPEAT))


@functools.cache
def texts(big: bool = True) -> st.SearchStrategy[str]:
    """Strings: short random Unicode, odd ones, (`big`) huge ones."""
    small = st.one_of(st.text(max_size=40), st.sampled_from(ODD_STRINGS))
    return st.one_of(small, huge_text()) if big else small


@functools.cache
def _scalar(fd: FieldDescriptor, big: bool) -> st.SearchStrategy[Any]:
    """Values of a scalar field over its whole range; `big`: strings and bytes may be huge."""
    t = fd.type
    if t in _RANGES:
        return _with_extremes(*_RANGES[t])
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_DOUBLE:
        return st.floats()
    if t == FD.TYPE_FLOAT:
        return st.floats(width=32)
    if t == FD.TYPE_STRING:
        return texts(big)
    if t == FD.TYPE_BYTES:
        huge = st.builds(lambda b, n: b * n, st.binary(min_size=1, max_size=8), st.integers(100, 100_000))
        return st.one_of(st.binary(max_size=64), huge) if big else st.binary(max_size=64)
    if t == FD.TYPE_ENUM:
        assert fd.enum_type is not None
        known = [v.number for v in fd.enum_type.values]
        return st.one_of(st.sampled_from(known), _with_extremes(-(2**31), 2**31 - 1))
    raise ValueError(f"no strategy for field type {t} of {fd.full_name}")


def _repeated(element: st.SearchStrategy[Any], long_max: int) -> st.SearchStrategy[list[Any]]:
    """Empty, short, or (`long_max` > 0) long: one drawn element repeated, so a long list costs one draw."""
    short = st.one_of(st.just([]), st.lists(element, max_size=6))
    return st.one_of(short, st.builds(lambda v, n: [v] * n, element, st.integers(100, long_max))) if long_max else short


@functools.cache
def _field(fd: FieldDescriptor, depth: int, big: bool) -> st.SearchStrategy[Any]:
    """A field's values. Only the singular path from the top is `big` (huge strings, long lists): the
    elements of a repeated field or map are small, so sizes add up instead of multiplying."""
    if fd.type == FD.TYPE_MESSAGE:
        sub = _message_type(fd)
        if sub.GetOptions().map_entry:
            key = _scalar(sub.fields_by_name["key"], False)
            value_fd = sub.fields_by_name["value"]
            is_msg = value_fd.type == FD.TYPE_MESSAGE
            value = messages(_message_type(value_fd), depth + 1, False) if is_msg else _scalar(value_fd, False)
            return st.dictionaries(key, value, max_size=6)
        if _is_repeated(fd):
            return _repeated(messages(sub, depth + 1, False), MAX_LONG_MESSAGES if big else 0)
        return messages(sub, depth + 1, big)
    if _is_repeated(fd):
        return _repeated(_scalar(fd, False), MAX_LONG_REPEATED if big else 0)
    return _scalar(fd, big)


SANE_STRINGS = ("", "a", "local", "v1", "worker-0", "tenant-a", "hello world", "127.0.0.1:1")


@functools.cache
def _sane_scalar(fd: FieldDescriptor) -> st.SearchStrategy[Any]:
    """Values a well-meaning client sends: small numbers, short known-looking strings, known enum values."""
    t = fd.type
    if t in _RANGES:
        return st.integers(0, 64)
    if t in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return st.one_of(st.sampled_from([0.0, 0.5, 1.0]), st.floats(0.0, 2.0, width=32))
    if t == FD.TYPE_STRING:
        return st.sampled_from(SANE_STRINGS)
    if t == FD.TYPE_BYTES:
        return st.binary(max_size=32)
    if t == FD.TYPE_ENUM:
        assert fd.enum_type is not None
        return st.sampled_from([v.number for v in fd.enum_type.values])
    return st.booleans()


def _sane_field(fd: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if fd.type != FD.TYPE_MESSAGE:
        element = _sane_scalar(fd)
    elif _message_type(fd).GetOptions().map_entry:
        key, value_fd = _message_type(fd).fields_by_name["key"], _message_type(fd).fields_by_name["value"]
        is_msg = value_fd.type == FD.TYPE_MESSAGE
        value = plausible(_message_type(value_fd), depth + 1) if is_msg else _sane_scalar(value_fd)
        return st.dictionaries(_sane_scalar(key), value, max_size=3)
    else:
        element = plausible(_message_type(fd), depth + 1)
    return st.lists(element, max_size=4) if _is_repeated(fd) else element


@functools.lru_cache(maxsize=1024)
def plausible(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of small, sane values (no huge or extreme ones): more of them pass validation, so the
    fuzzer also reaches the code behind it."""
    if depth >= MAX_DEPTH:
        return st.just(message_factory.GetMessageClass(desc)())
    optional = {fd.name: _sane_field(fd, depth) for fd in desc.fields}
    return st.fixed_dictionaries({}, optional=optional).map(functools.partial(_build, desc))


def _set(msg: Message, fd: FieldDescriptor, value: Any) -> None:
    """Sets one field (a value the field refuses, e.g. an unknown closed enum, is left out)."""
    try:
        if fd.type == FD.TYPE_MESSAGE and _message_type(fd).GetOptions().map_entry:
            target = getattr(msg, fd.name)
            for k, v in value.items():
                if isinstance(v, Message):
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif _is_repeated(fd):
            target = getattr(msg, fd.name)
            if fd.type == FD.TYPE_MESSAGE:
                for v in value:
                    target.add().CopyFrom(v)
            else:
                target.extend(value)
        elif fd.type == FD.TYPE_MESSAGE:
            getattr(msg, fd.name).CopyFrom(value)
        else:
            setattr(msg, fd.name, value)
    except (ValueError, TypeError):
        pass


def _build(desc: Descriptor, values: dict[str, Any]) -> Message:
    msg = message_factory.GetMessageClass(desc)()
    for name, value in values.items():
        _set(msg, desc.fields_by_name[name], value)
    return msg


@functools.lru_cache(maxsize=1024)
def messages(desc: Descriptor, depth: int = 0, big: bool = True) -> st.SearchStrategy[Message]:
    """Valid messages of type `desc`, any subset of the fields set (below `MAX_DEPTH`: empty ones)."""
    if depth >= MAX_DEPTH:
        return st.just(message_factory.GetMessageClass(desc)())
    optional = {fd.name: _field(fd, depth, big) for fd in desc.fields}
    return st.fixed_dictionaries({}, optional=optional).map(functools.partial(_build, desc))


@functools.cache
def _payload(wt: int) -> st.SearchStrategy[bytes]:
    """Well-formed bytes of one wire type (after the key)."""
    if wt == 0:
        return st.integers(0, 2**64 - 1).map(varint)
    if wt == 1:
        return st.binary(min_size=8, max_size=8)
    if wt == 5:
        return st.binary(min_size=4, max_size=4)
    return st.binary(max_size=64).map(lambda b: varint(len(b)) + b)


def _key(number: int, wt: int) -> bytes:
    return varint((number << 3) | wt)


def _unknown_field(desc: Descriptor) -> st.SearchStrategy[bytes]:
    known = {fd.number for fd in desc.fields}
    number = st.integers(1, FIELD_NUMBER_MAX).filter(lambda n: n not in known and n not in RESERVED)

    def encode(n: int, wt: int, payload: bytes) -> bytes:
        if wt == 3:  # a group: start, one varint field inside, end with the same number
            return _key(n, 3) + _key(1, 0) + payload + _key(n, 4)
        return _key(n, wt) + payload

    wts = st.sampled_from([0, 1, 2, 3, 5])
    return st.builds(
        lambda n, wt, data: encode(n, wt, data.draw(_payload(0 if wt == 3 else wt))), number, wts, st.data()
    )


def with_unknown_fields(desc: Descriptor) -> st.SearchStrategy[bytes]:
    """A valid message with 1-4 undeclared fields appended."""
    extra = st.lists(_unknown_field(desc), min_size=1, max_size=4).map(b"".join)
    return st.builds(lambda m, x: m.SerializeToString() + x, messages(desc), extra)


def wrong_wire_type(desc: Descriptor) -> st.SearchStrategy[bytes]:
    """A declared field with a wire type other than its own (a valid message around it)."""
    if not desc.fields:
        return with_unknown_fields(desc)

    def encode(m: Message, fd: FieldDescriptor, data: st.DataObject) -> bytes:
        wt = data.draw(_other_wire_types(wire_type(fd)))
        return m.SerializeToString() + _key(fd.number, wt) + data.draw(_payload(wt))

    return st.builds(encode, messages(desc), st.sampled_from(list(desc.fields)), st.data())


@functools.cache
def _other_wire_types(own: int) -> st.SearchStrategy[int]:
    return st.sampled_from([w for w in (0, 1, 2, 5) if w != own])


def truncated(desc: Descriptor) -> st.SearchStrategy[bytes]:
    """A valid encoding of at least 2 bytes cut at a random point."""

    def cut(raw: bytes, data: st.DataObject) -> bytes:
        return raw[: data.draw(st.integers(1, len(raw) - 1))]

    long_enough = messages(desc).map(lambda m: m.SerializeToString()).filter(lambda b: len(b) >= 2)
    return st.builds(cut, long_enough, st.data()) if desc.fields else st.just(b"\x0a")


def bad_utf8(desc: Descriptor) -> st.SearchStrategy[bytes]:
    """A string field holding bytes that are not UTF-8 (the other fields valid)."""
    strings = [fd for fd in desc.fields if fd.type == FD.TYPE_STRING]
    if not strings:
        return wrong_wire_type(desc)
    junk = st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"a\xf0\x9f\x98", b"\x80" * 9])
    return st.builds(
        lambda m, fd, j: m.SerializeToString() + length_delimited(fd.number, j),
        messages(desc),
        st.sampled_from(strings),
        junk,
    )


@functools.cache
def malformed() -> st.SearchStrategy[bytes]:
    """Bytes no message decodes from (or decodes by chance: random bytes)."""
    fixed = [
        b"\x08" + b"\xff" * 10 + b"\x01",  # an 11-byte varint
        b"\x00\x01",  # field number 0
        b"\x0e\x01",  # wire type 6
        b"\x0f\x01",  # wire type 7
        b"\x0a\xff\xff\xff\xff\x0f",  # a length past the end
        b"\x0b\x10\x01",  # a group never closed
        b"\x0c",  # a group end with no start
    ]
    return st.one_of(st.sampled_from(fixed), st.binary(max_size=256))


Mutator = Callable[[Descriptor], st.SearchStrategy[bytes]]
KINDS: dict[str, Mutator] = {
    "plausible": lambda d: plausible(d).map(lambda m: m.SerializeToString()),
    "valid": lambda d: messages(d).map(lambda m: m.SerializeToString()).filter(lambda b: len(b) <= MAX_MESSAGE_BYTES),
    "unknown-fields": with_unknown_fields,
    "wrong-wire-type": wrong_wire_type,
    "truncated": truncated,
    "bad-utf8": bad_utf8,
    "malformed": lambda _d: malformed(),
}


@functools.cache
def encodings(desc: Descriptor) -> st.SearchStrategy[tuple[str, bytes]]:
    """(kind, wire bytes) of one request message of type `desc` (kinds: `KINDS`)."""
    return st.one_of(*(f(desc).map(functools.partial(_tagged, kind)) for kind, f in KINDS.items()))


def _tagged(kind: str, raw: bytes) -> tuple[str, bytes]:
    return kind, raw


_STREAM_LENGTHS = st.integers(1, 4)


@dataclass(frozen=True)
class GrpcCase:
    """The request messages of one call (one for a unary request, 1-4 for a request stream)."""

    method: RpcMethod
    kinds: tuple[str, ...]
    messages: tuple[bytes, ...]


def grpc_cases(methods: list[RpcMethod]) -> st.SearchStrategy[GrpcCase]:
    """A call of any of `methods`."""

    def case(m: RpcMethod, data: st.DataObject) -> GrpcCase:
        n = data.draw(_STREAM_LENGTHS) if m.client_streaming else 1
        drawn = [data.draw(encodings(m.input)) for _ in range(n)]
        return GrpcCase(m, tuple(k for k, _ in drawn), tuple(b for _, b in drawn))

    return st.builds(case, st.sampled_from(methods), st.data())
