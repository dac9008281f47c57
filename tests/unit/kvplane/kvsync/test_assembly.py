"""The gRPC client's block assembly: chunks copied into the caller's buffers with the CRC32C in the copy's
pass (continued across a block's chunks, which may arrive in separate messages), kernel and fallback alike."""

from __future__ import annotations

import itertools
import os

import crc32c
import pytest

from kvmesh.kvplane.kvsync import tier
from kvmesh.kvplane.kvsync.client import BlockAssembly, PullStats
from kvmesh.kvplane.kvsync.codec import Chunk, decode_chunks, encode_chunks
from kvmesh.kvplane.kvsync.tier import CorruptBlock

pytestmark = pytest.mark.unit

BLOCK = 40_000
PIECE = 16_384  # chunks of 16384, 16384, 7232 bytes: first, middle, last


def _messages(blocks: list[bytes], crcs: list[int]) -> list[list[Chunk]]:
    """Each chunk in its own ReadBlocksResponse, through the codec both ways (as the client receives them)."""
    out = []
    for index, (data, crc) in enumerate(zip(blocks, crcs, strict=True)):
        view = memoryview(data)
        for offset in range(0, len(view), PIECE):
            piece = view[offset : offset + PIECE]
            last = offset + len(piece) == len(view)
            out.append(decode_chunks(encode_chunks([Chunk(index, offset, piece, last, crc if last else 0)])))
    return out


def _assemble(messages: list[list[Chunk]], n: int, verify: bool = True) -> tuple[list[memoryview], PullStats]:
    outs = [memoryview(bytearray(BLOCK)) for _ in range(n)]
    stats = PullStats("grpc")
    assembly = BlockAssembly(outs, n, stats, verify=verify)
    for message in messages:
        for chunk in message:
            assembly.add(chunk)
    assembly.finish()
    return outs, stats


def test_multi_chunk_blocks_arrive_whole_and_checked(kernel: str) -> None:
    blocks = [os.urandom(BLOCK) for _ in range(3)]
    outs, stats = _assemble(_messages(blocks, [crc32c.crc32c(b) for b in blocks]), 3)
    assert [bytes(o) for o in outs] == blocks
    assert (stats.blocks, stats.bytes, stats.lengths) == (3, 3 * BLOCK, [BLOCK] * 3)


@pytest.mark.parametrize("at", [0, 5_000, PIECE, 20_000, 2 * PIECE, BLOCK - 1])  # first, middle, last chunk
def test_a_corrupted_byte_in_any_chunk_is_detected(kernel: str, at: int) -> None:
    blocks = [os.urandom(BLOCK) for _ in range(2)]
    crcs = [crc32c.crc32c(b) for b in blocks]
    bad = bytearray(blocks[1])
    bad[at] ^= 0x10  # corrupted on the way: the CRC is the one written with the block
    with pytest.raises(CorruptBlock, match="block 1"):
        _assemble(_messages([blocks[0], bytes(bad)], crcs), 2)
    outs, stats = _assemble(_messages([blocks[0], bytes(bad)], crcs), 2, verify=False)
    assert bytes(outs[1]) == bytes(bad) and stats.blocks == 2  # unverified, the same copies pass it through


def test_kernel_and_fallback_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    if tier._kernel is None:
        pytest.skip("the CRC kernel is not built here")
    data = os.urandom(3 * BLOCK + 13)
    cuts = [0, 1, 700, 768, 16_384, 40_000, len(data)]
    results = {}
    for mode in ("kernel", "fallback"):
        if mode == "fallback":
            monkeypatch.setattr(tier, "_kernel", None)
        dest = memoryview(bytearray(len(data)))
        crc = 0
        for a, b in itertools.pairwise(cuts):
            crc = tier.copy_checksum(dest[a:b], memoryview(data)[a:b], crc)
        results[mode] = (crc, bytes(dest))
    assert results["kernel"] == results["fallback"] == (crc32c.crc32c(data), data)
