"""Reading one JSON value of an OpenAI request (pure): typed, or `InvalidArgument` naming the field (the HTTP
`param`). Every parser module of `kvmesh.openai` reads its fields with these, so a type is checked one way:
an integer is never a boolean, text is valid Unicode (a lone surrogate such as "\\ud800", which JSON can carry
but UTF-8 cannot, is refused), an object has only the keys it may have.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvmesh.core.errors import InvalidArgument


def check_text(value: str, field: str) -> str:
    """`value`, or InvalidArgument when it cannot be UTF-8 encoded (a lone surrogate from a JSON escape)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument(field, f"invalid Unicode at character {e.start} (a lone surrogate?)") from None
    return value


def check_keys(obj: dict[str, Any], keys: Collection[str], where: str, why: str, skip_null: bool = False) -> None:
    """InvalidArgument naming `where.<key>` (`<key>` when `where` is "") for the first key of `obj` outside
    `keys`, with `why`; `skip_null`: a key whose value is null passes (OpenAI's clients send some as null)."""
    extra = next((k for k in obj if k not in keys and not (skip_null and obj[k] is None)), None)
    if extra is not None:
        raise InvalidArgument(f"{where}.{extra}" if where else extra, why)


def is_off(value: object, offs: tuple[object, ...]) -> bool:
    """One of `offs` of the same type (True is not 1, 0.0 is not 0)."""
    return any(type(value) is type(off) and value == off for off in offs)


def is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_field(body: dict[str, Any], key: str, default: int | None) -> Any:
    """`body[key]` as an integer; `default` when absent or null."""
    v = body.get(key)
    if v is None:
        return default
    if not is_int(v):
        raise InvalidArgument(key, "must be an integer")
    return v


def float_field(body: dict[str, Any], key: str, default: float) -> float:
    """`body[key]` as a number; `default` when absent or null."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise InvalidArgument(key, "must be a number")
    return float(v)


def bool_field(body: dict[str, Any], key: str, name: str = "", default: bool = False) -> bool:
    """`body[key]` as a boolean (`name`: the field as the error names it, `key` by default)."""
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidArgument(name or key, "must be a boolean")
    return v


def str_field(body: dict[str, Any], key: str) -> str:
    """`body[key]` as text ("" when absent or null)."""
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise InvalidArgument(key, "must be a string")
    return check_text(v or "", key)


def opt_text(obj: dict[str, Any], key: str, where: str) -> str | None:
    """`obj[key]` as text, None when absent or null; errors name `where`."""
    v = obj.get(key)
    if v is not None and not isinstance(v, str):
        raise InvalidArgument(where, "must be a string")
    return None if v is None else check_text(v, where)


def strings(body: dict[str, Any], key: str) -> tuple[str, ...]:
    """`body[key]` as a list of strings (() when absent or null)."""
    v = body.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise InvalidArgument(key, "must be a list of strings")
    return tuple(check_text(s, key) for s in v)


def token_ids(body: dict[str, Any], key: str) -> tuple[int, ...]:
    """`body[key]` as a list of integers (() when absent or null; bounds are the caller's)."""
    v = body.get(key)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(is_int(t) for t in v):
        raise InvalidArgument(key, "must be a list of token ids")
    return tuple(v)
