"""Hand-built wire bytes of `ReadBlocksResponse` (pure), so block data is copied once into the message on the
server and sliced, not copied, out of it on the client.

The generated code would copy each block twice on each side: into a `bytes` field, then into the serialised
message (server); into the parsed field, then out of it (client). Here the server joins headers and
memoryviews of the region straight into the message bytes, and the client gets memoryviews into the bytes
grpc handed it. The format is exactly the proto's (`kvmesh.v1.ReadBlocksResponse`): a generated parser reads
what `encode_chunks` writes, and `decode_chunks` reads what a generated serialiser writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.wire.protowire import read_varint, varint

# field numbers of BlockChunk (kvsync.proto)
_INDEX, _OFFSET, _DATA, _LAST, _CRC = 1, 2, 3, 4, 5
_CHUNKS = 1  # ReadBlocksResponse.chunks


@dataclass(frozen=True)
class Chunk:
    """A piece of one block: `data` is a view (into the region on the server, into the message on the
    client)."""

    index: int
    offset: int
    data: memoryview
    last: bool
    crc32c: int


def _key(number: int, wire: int) -> bytes:
    return varint((number << 3) | wire)


def _head(chunk: Chunk) -> bytes:
    """A BlockChunk's fields before its data, and the data's key and length."""
    out = b""
    if chunk.index:
        out += _key(_INDEX, 0) + varint(chunk.index)
    if chunk.offset:
        out += _key(_OFFSET, 0) + varint(chunk.offset)
    return out + _key(_DATA, 2) + varint(len(chunk.data))


def _tail(chunk: Chunk) -> bytes:
    out = b""
    if chunk.last:
        out += _key(_LAST, 0) + b"\x01"
    if chunk.crc32c:
        out += _key(_CRC, 0) + varint(chunk.crc32c)
    return out


def encode_chunks(chunks: Sequence[Chunk]) -> bytes:
    """One serialised ReadBlocksResponse: the only copy of the data is the final join."""
    parts: list[bytes | memoryview] = []
    for chunk in chunks:
        head, tail = _head(chunk), _tail(chunk)
        parts += (_key(_CHUNKS, 2), varint(len(head) + len(chunk.data) + len(tail)), head, chunk.data, tail)
    return b"".join(parts)


def _skip(buf: memoryview, pos: int, wire: int) -> int:
    if wire == 0:
        return read_varint(buf, pos)[1]
    if wire == 2:
        size, pos = read_varint(buf, pos)
        return pos + size
    if wire == 1:
        return pos + 8
    if wire == 5:
        return pos + 4
    raise ValueError(f"unsupported wire type {wire}")


def _decode_chunk(buf: memoryview) -> Chunk:
    index = offset = crc = 0
    last = False
    data = buf[0:0]
    pos = 0
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0 and number in (_INDEX, _OFFSET, _LAST, _CRC):
            value, pos = read_varint(buf, pos)
            if number == _INDEX:
                index = value
            elif number == _OFFSET:
                offset = value
            elif number == _LAST:
                last = bool(value)
            else:
                crc = value
        elif wire == 2 and number == _DATA:
            size, pos = read_varint(buf, pos)
            if pos + size > len(buf):
                raise ValueError("data runs past the chunk")
            data = buf[pos : pos + size]
            pos += size
        else:
            pos = _skip(buf, pos, wire)
    if pos != len(buf):
        raise ValueError("chunk ends inside a field")
    return Chunk(index, offset, data, last, crc)


def decode_chunks(raw: bytes) -> list[Chunk]:
    """The chunks of a serialised ReadBlocksResponse, their data as views into `raw` (no copy); ValueError
    on bytes that are not one."""
    buf = memoryview(raw)
    out: list[Chunk] = []
    pos = 0
    try:
        while pos < len(buf):
            key, pos = read_varint(buf, pos)
            if key == (_CHUNKS << 3) | 2:
                size, pos = read_varint(buf, pos)
                if pos + size > len(buf):
                    raise ValueError("chunk runs past the message")
                out.append(_decode_chunk(buf[pos : pos + size]))
                pos += size
            else:
                pos = _skip(buf, pos, key & 7)
    except IndexError:
        raise ValueError("message ends inside a field") from None
    if pos != len(buf):
        raise ValueError("message ends inside a field")
    return out
