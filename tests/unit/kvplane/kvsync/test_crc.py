"""The interleaved CRC32C kernel and its checked copy agree with the `crc32c` package byte for byte."""

from __future__ import annotations

import os
import random

import crc32c
import pytest

from kvmesh.kvplane.kvsync import tier

pytestmark = pytest.mark.unit

# lengths around the kernel's edges: empty, sub-word, the three-lane threshold (768), odd tails, big blocks
LENGTHS = [0, 1, 7, 8, 9, 255, 767, 768, 769, 1000, 4096, 16384, 16387, (1 << 20) + 13]


@pytest.mark.parametrize("n", LENGTHS)
def test_checksum_and_checked_copy_match_the_reference(kernel: str, n: int) -> None:
    data = os.urandom(n)
    want = crc32c.crc32c(data)
    assert tier.checksum(data) == want
    assert tier.checksum(memoryview(data)) == want
    dest = memoryview(bytearray(n))
    assert tier.copy_checksum(dest, memoryview(data)) == want
    assert bytes(dest) == data


def test_a_flipped_bit_anywhere_changes_the_crc(kernel: str) -> None:
    rng = random.Random(7)
    data = bytearray(os.urandom(16384))
    want = tier.checksum(data)
    for _ in range(64):
        i, bit = rng.randrange(len(data)), 1 << rng.randrange(8)
        data[i] ^= bit
        assert tier.checksum(data) != want
        dest = memoryview(bytearray(len(data)))
        assert tier.copy_checksum(dest, memoryview(data)) != want
        data[i] ^= bit


def test_kernel_continues_a_crc_like_the_package() -> None:
    if tier._kernel is None:
        pytest.skip("the CRC kernel is not built here")
    data = os.urandom(50_000)
    for cut in (0, 1, 768, 12_345, 50_000):
        assert tier._kernel.crc32c(data[cut:], tier._kernel.crc32c(data[:cut])) == crc32c.crc32c(data)


@pytest.mark.parametrize("cut", [0, 1, 767, 768, 12_345, 50_000])
def test_checked_copy_continues_a_crc(kernel: str, cut: int) -> None:
    data = memoryview(os.urandom(50_000))
    dest = memoryview(bytearray(len(data)))
    head = tier.copy_checksum(dest[:cut], data[:cut])
    assert tier.copy_checksum(dest[cut:], data[cut:], head) == crc32c.crc32c(data)
    assert bytes(dest) == bytes(data)


def test_checked_copy_refuses_unequal_lengths() -> None:
    if tier._kernel is None:
        pytest.skip("the CRC kernel is not built here")
    with pytest.raises(ValueError, match="dst is 10 bytes, src 11"):
        tier._kernel.copy_crc32c(bytearray(10), b"x" * 11)


@pytest.mark.skipif(os.environ.get("KVMESH_REQUIRE_NATIVE") != "1", reason="native build not required here")
def test_kernel_is_built_where_required() -> None:
    assert tier._kernel is not None, "kvmesh.kvplane.kvsync._crc failed to build (or the CPU lacks SSE4.2)"
