"""The ReadBlocksResponse codec at its edges: the bytes it writes are exactly the generated serialiser's, it
reads what any protobuf writer may send (fields in any order, repeated scalars, unknown fields of every wire
type), and it refuses, with a ValueError that says where, bytes that are not one message."""

from __future__ import annotations

import pytest

from kvmesh.kvplane.kvsync.codec import Chunk, decode_chunks, encode_chunks
from kvmesh.v1 import kvsync_pb2
from kvmesh.wire.protowire import varint

pytestmark = pytest.mark.unit


def key(number: int, wire: int) -> bytes:
    return varint((number << 3) | wire)


def chunk_field(payload: bytes) -> bytes:
    """ReadBlocksResponse.chunks (field 1, length-delimited) holding one BlockChunk's bytes."""
    return key(1, 2) + varint(len(payload)) + payload


def fields(chunk: Chunk) -> tuple[int, int, bytes, bool, int]:
    return chunk.index, chunk.offset, bytes(chunk.data), chunk.last, chunk.crc32c


@pytest.mark.parametrize(
    "chunk",
    [
        Chunk(0, 0, memoryview(b"x"), False, 0),  # every default: only the data field is written
        Chunk(1, 0, memoryview(b"ab"), False, 0),
        Chunk(0, 1, memoryview(b"ab"), False, 0),
        Chunk(0, 0, memoryview(b"ab"), True, 0),
        Chunk(0, 0, memoryview(b"ab"), False, 1),
        Chunk(300, 200_000, memoryview(bytes(range(256)) * 3), True, 0xFFFFFFFF),  # multi-byte varints
    ],
)
def test_encoded_bytes_are_exactly_the_generated_serialisers(chunk: Chunk) -> None:
    generated = kvsync_pb2.ReadBlocksResponse(
        chunks=[
            kvsync_pb2.BlockChunk(
                index=chunk.index, offset=chunk.offset, data=bytes(chunk.data), last=chunk.last, crc32c=chunk.crc32c
            )
        ]
    )
    assert encode_chunks([chunk]) == generated.SerializeToString()
    assert encode_chunks([chunk, chunk]) == generated.SerializeToString() * 2  # repeated chunks concatenate


def test_no_chunks_encode_to_the_empty_message_and_decode_back() -> None:
    assert encode_chunks([]) == b""
    assert decode_chunks(b"") == []


def test_fields_in_any_order_and_the_last_of_a_repeated_scalar_win() -> None:
    payload = b"".join(
        [
            key(5, 0) + varint(7),  # crc first
            key(4, 0) + varint(1),
            key(3, 2) + varint(3) + b"old",
            key(2, 0) + varint(128),
            key(1, 0) + varint(1),
            key(1, 0) + varint(9),  # a later index replaces the first, as a generated parser does
            key(3, 2) + varint(3) + b"new",
        ]
    )
    (got,) = decode_chunks(chunk_field(payload))
    assert fields(got) == (9, 128, b"new", True, 7)
    assert fields(got) == fields(_generated_parse(chunk_field(payload)))


def _generated_parse(raw: bytes) -> Chunk:
    (c,) = kvsync_pb2.ReadBlocksResponse.FromString(raw).chunks
    return Chunk(c.index, c.offset, memoryview(c.data), c.last, c.crc32c)


@pytest.mark.parametrize("value, last", [(0, False), (1, True), (2, True)])
def test_last_is_any_non_zero_varint(value: int, last: bool) -> None:
    (got,) = decode_chunks(chunk_field(key(4, 0) + varint(value) + key(3, 2) + varint(1) + b"z"))
    assert got.last is last


def test_unknown_fields_of_every_wire_type_are_skipped_in_a_chunk_and_in_the_message() -> None:
    unknown = b"".join(
        [
            key(9, 0) + varint(1 << 40),
            key(10, 1) + b"\xff" * 8,
            key(11, 5) + b"\xff" * 4,
            key(12, 2) + varint(5) + b"\x0a" * 5,
        ]
    )
    # known numbers on the wrong wire type are unknown fields too (a newer schema's, not ours)
    misplaced = key(1, 2) + varint(2) + b"\x08\x05" + key(3, 0) + varint(4) + key(5, 5) + b"\x01\x02\x03\x04"
    payload = unknown + misplaced + key(1, 0) + varint(3) + key(3, 2) + varint(4) + b"data" + unknown
    message = unknown + key(1, 0) + varint(77) + chunk_field(payload) + unknown + key(1, 5) + b"\x00" * 4
    (got,) = decode_chunks(message)
    assert fields(got) == (3, 0, b"data", False, 0)
    assert fields(got) == fields(_generated_parse(message))


@pytest.mark.parametrize("wire", [3, 4, 6, 7])
def test_an_unsupported_wire_type_is_refused_naming_it(wire: int) -> None:
    with pytest.raises(ValueError, match=f"^unsupported wire type {wire}$"):
        decode_chunks(key(2, wire) + b"\x00")
    with pytest.raises(ValueError, match=f"^unsupported wire type {wire}$"):
        decode_chunks(chunk_field(key(9, wire) + b"\x00"))


def test_data_that_ends_exactly_at_the_chunks_end_is_read_one_byte_more_is_refused() -> None:
    (got,) = decode_chunks(chunk_field(key(3, 2) + varint(4) + b"data"))
    assert bytes(got.data) == b"data"
    with pytest.raises(ValueError, match=r"^data runs past the chunk$"):
        decode_chunks(chunk_field(key(3, 2) + varint(5) + b"data"))


def test_a_chunk_that_ends_exactly_at_the_messages_end_is_read_one_byte_more_is_refused() -> None:
    payload = key(3, 2) + varint(2) + b"ok"
    assert len(decode_chunks(key(1, 2) + varint(len(payload)) + payload)) == 1
    with pytest.raises(ValueError, match=r"^chunk runs past the message$"):
        decode_chunks(key(1, 2) + varint(len(payload) + 1) + payload)


def test_a_fixed_width_field_cut_short_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^chunk ends inside a field$"):
        decode_chunks(chunk_field(key(9, 1) + b"\x00" * 7))
    with pytest.raises(ValueError, match=r"^chunk ends inside a field$"):
        decode_chunks(chunk_field(key(9, 5) + b"\x00" * 3))
    with pytest.raises(ValueError, match=r"^message ends inside a field$"):
        decode_chunks(key(9, 5) + b"\x00" * 3)
    with pytest.raises(ValueError, match=r"^message ends inside a field$"):
        decode_chunks(key(9, 2) + varint(4) + b"abc")


def test_a_varint_cut_short_is_refused_as_a_message_ending_inside_a_field() -> None:
    with pytest.raises(ValueError, match=r"^message ends inside a field$"):
        decode_chunks(b"\x80")  # a key whose varint never ends
    with pytest.raises(ValueError, match=r"^message ends inside a field$"):
        decode_chunks(chunk_field(key(1, 0) + b"\x80"))  # the index's varint ends with the chunk
