"""Hand-built protobuf wire bytes, for hot paths that append a pre-serialised field to a message instead of
copying a large message (protobuf parses fields in any order, and repeated packed chunks concatenate)."""

from __future__ import annotations


def varint(n: int) -> bytes:
    """Base-128 varint of a non-negative int."""
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    """Field `number` (wire type 2: a message, bytes or packed repeated field) holding `payload`."""
    return varint((number << 3) | 2) + varint(len(payload)) + payload


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """(value, next position) of the varint at `pos`; IndexError when `buf` ends inside it."""
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def field_payload(buf: bytes, number: int, oneof_siblings: frozenset[int] = frozenset()) -> bytes | None:
    """The payload of length-delimited field `number` at the top level of the serialised message `buf`, so a
    hot path can forward a sub-message's wire bytes instead of re-serialising it. Several occurrences are
    concatenated (what a parser does: they merge). None when the field is absent, when a field of
    `oneof_siblings` (the other members of `number`'s oneof) is present too (a parser keeps only what follows
    the last switch), or when `buf` holds something this scanner does not walk (groups, a malformed tail):
    the caller then serialises instead."""
    parts: list[bytes] = []
    pos, end = 0, len(buf)
    try:
        while pos < end:
            key, pos = read_varint(buf, pos)
            if key >> 3 in oneof_siblings:
                return None
            wire = key & 7
            if wire == 0:
                _, pos = read_varint(buf, pos)
            elif wire == 2:
                size, pos = read_varint(buf, pos)
                if pos + size > end:
                    return None
                if key >> 3 == number:
                    parts.append(buf[pos : pos + size])
                pos += size
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                return None
    except (IndexError, ValueError):
        return None
    if pos != end or not parts:
        return None
    return parts[0] if len(parts) == 1 else b"".join(parts)
