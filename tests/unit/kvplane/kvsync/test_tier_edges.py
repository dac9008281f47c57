"""The kv-sync tier's block length at its edges: a block is 1..block_bytes bytes. An empty block is refused
(naming the field), by `put` and by `publish` alike; one byte and exactly block_bytes are stored whole."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.kvplane.kvsync.tier import RegionReader, TierRegion

pytestmark = pytest.mark.unit
BLOCK = 4096
LAYOUT = "tiny-llama|bfloat16|bs32|vllm-cpu"


def _digest(i: int) -> bytes:
    return hashlib.sha256(f"edge-{i}".encode()).digest()


@pytest.fixture
def region() -> Iterator[TierRegion]:
    r = TierRegion.create(f"kvmesh-ut-edge-{os.getpid()}-{os.urandom(4).hex()}", BLOCK, 4, LAYOUT)
    yield r
    r.close()


@pytest.fixture
def reader(region: TierRegion) -> Iterator[RegionReader]:
    rd = RegionReader.attach(region.shm_name)
    yield rd
    rd.close()


def test_an_empty_block_is_refused_by_put(region: TierRegion) -> None:
    with pytest.raises(InvalidArgument) as e:
        region.put(_digest(0), b"", now_ns=1)
    assert e.value.field == "data" and f"1..{BLOCK}" in str(e.value)
    assert len(region) == 0


@pytest.mark.parametrize("length", [1, BLOCK])
def test_one_byte_and_a_full_block_are_stored_whole(region: TierRegion, reader: RegionReader, length: int) -> None:
    data = bytes((7 * k + 3) % 251 for k in range(length))
    assert region.put(_digest(length), data, now_ns=1)
    (ref,) = reader.locate([_digest(length)])
    assert ref is not None
    out = bytearray(BLOCK)
    assert reader.read_into(ref, _digest(length), memoryview(out)) == length
    assert bytes(out[:length]) == data


@pytest.mark.parametrize("length", [0, BLOCK + 1])
def test_publish_refuses_an_empty_or_oversize_length(region: TierRegion, length: int) -> None:
    res = region.reserve(_digest(9), now_ns=1)
    assert res is not None
    with pytest.raises(InvalidArgument) as e:
        region.publish(res, length, 0, now_ns=2)
    assert e.value.field == "length"
    region.abort(res)


@pytest.mark.parametrize("length", [1, BLOCK])
def test_publish_takes_one_byte_and_a_full_block(region: TierRegion, reader: RegionReader, length: int) -> None:
    from kvmesh.kvplane.kvsync.tier import checksum

    res = region.reserve(_digest(10 + length), now_ns=1)
    assert res is not None
    data = bytes((5 * k + 1) % 251 for k in range(length))
    res.data[:length] = data
    ref = region.publish(res, length, checksum(data), now_ns=2)
    out = bytearray(BLOCK)
    assert reader.read_into(ref, _digest(10 + length), memoryview(out)) == length
    assert bytes(out[:length]) == data
