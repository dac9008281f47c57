"""The hand-built ReadBlocksResponse wire bytes agree with the generated code both ways."""

from __future__ import annotations

import os

import pytest

from kvmesh.kvplane.kvsync.codec import Chunk, decode_chunks, encode_chunks
from kvmesh.v1 import kvsync_pb2

pytestmark = pytest.mark.unit


def _chunks() -> list[Chunk]:
    big = memoryview(os.urandom(300_000))
    return [
        Chunk(0, 0, memoryview(b"abc"), True, 0xFFFFFFFF),
        Chunk(1, 0, big[:200_000], False, 0),
        Chunk(1, 200_000, big[200_000:], True, 12345),
        Chunk(2, 0, memoryview(b""), True, 0),
    ]


def test_generated_parser_reads_what_encode_writes() -> None:
    chunks = _chunks()
    msg = kvsync_pb2.ReadBlocksResponse.FromString(encode_chunks(chunks))
    assert [(c.index, c.offset, c.data, c.last, c.crc32c) for c in msg.chunks] == [
        (c.index, c.offset, bytes(c.data), c.last, c.crc32c) for c in chunks
    ]


def test_decode_reads_what_the_generated_serialiser_writes_as_views() -> None:
    chunks = _chunks()
    msg = kvsync_pb2.ReadBlocksResponse(
        chunks=[
            kvsync_pb2.BlockChunk(index=c.index, offset=c.offset, data=bytes(c.data), last=c.last, crc32c=c.crc32c)
            for c in chunks
        ]
    )
    raw = msg.SerializeToString()
    got = decode_chunks(raw)
    assert [(c.index, c.offset, bytes(c.data), c.last, c.crc32c) for c in got] == [
        (c.index, c.offset, bytes(c.data), c.last, c.crc32c) for c in chunks
    ]
    assert all(isinstance(c.data, memoryview) and c.data.obj is raw for c in got)  # sliced, not copied


@pytest.mark.parametrize("cut", [1, 5, 100])
def test_truncated_message_is_refused(cut: int) -> None:
    raw = encode_chunks(_chunks()[:2])
    with pytest.raises(ValueError):
        decode_chunks(raw[:-cut])
