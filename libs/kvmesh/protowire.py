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
