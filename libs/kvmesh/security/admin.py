"""Strict input of admin actions, HTTP and gRPC alike (one home for the checks every admin handler makes).

HTTP admin routes take only ``application/json`` bodies (:func:`require_json`): a web page can make a
browser send a cross-site ``text/plain``, form or multipart POST without a CORS preflight, never an
``application/json`` one, so an admin route that refuses the others is out of a CSRF's reach. Their fields
are typed (:func:`typed_fields`): a JSON ``"false"`` is a string, not a boolean, ``1`` is not ``true``, and a
field the route does not know is refused rather than ignored (a typo must not silently keep the default).

gRPC admin requests carry no field their schema lacks (:func:`no_unknown_fields`, checked through nested
messages): a client built from another proto version gets INVALID_ARGUMENT naming the field number instead of
a request applied with the unknown part dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from google.protobuf import unknown_fields
from google.protobuf.message import Message

from kvmesh.core.errors import InvalidArgument

JSON_TYPE = "application/json"


class UnsupportedMediaType(InvalidArgument):
    """An admin body that is not ``application/json`` (HTTP 415)."""

    audit_result = "UNSUPPORTED_MEDIA_TYPE"

    def __init__(self, content_type: str) -> None:
        super().__init__("Content-Type", f"admin routes take only {JSON_TYPE} bodies, got {content_type or 'none'!r}")


def require_json(content_type: str) -> None:
    """The request's media type (parameters such as ``charset`` aside) must be ``application/json``."""
    if content_type.split(";", 1)[0].strip().lower() != JSON_TYPE:
        raise UnsupportedMediaType(content_type)


def _kind_ok(value: object, kind: type) -> bool:
    """JSON type check: bool is not a number, a number is a finite int or float (int accepted for float)."""
    if kind is bool:
        return isinstance(value, bool)
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


_NAMES = {bool: "a boolean (true/false)", float: "a number", int: "an integer", str: "a string"}


def typed_fields(body: Mapping[str, Any], schema: Mapping[str, type]) -> dict[str, Any]:
    """The body's fields, each of its schema type (absent ones left out; ``null`` = absent); InvalidArgument
    naming the unknown fields, or the first field of a wrong type."""
    unknown = sorted(set(body) - set(schema))
    if unknown:
        raise InvalidArgument(", ".join(unknown), f"unknown field(s) {unknown}; this route takes {sorted(schema)}")
    out: dict[str, Any] = {}
    for name, kind in schema.items():
        v = body.get(name)
        if v is None:
            continue
        if not _kind_ok(v, kind):
            raise InvalidArgument(name, f"must be {_NAMES.get(kind, kind.__name__)}, got {type(v).__name__} {v!r}")
        out[name] = float(v) if kind is float else v
    return out


def no_unknown_fields(message: Message, path: str = "") -> None:
    """No field unknown to the message's schema, here or in a set sub-message (INVALID_ARGUMENT naming it)."""
    extra = unknown_fields.UnknownFieldSet(message)
    if len(extra):
        numbers = sorted({extra[i].field_number for i in range(len(extra))})
        raise InvalidArgument(path or "request", f"unknown field number(s) {numbers} in {message.DESCRIPTOR.name}")
    for fd, value in message.ListFields():
        if fd.message_type is None or fd.message_type.GetOptions().map_entry:
            continue
        name = f"{path}.{fd.name}" if path else fd.name
        items = value if fd.is_repeated else [value]
        for i, sub in enumerate(items):
            no_unknown_fields(sub, f"{name}[{i}]" if fd.is_repeated else name)
