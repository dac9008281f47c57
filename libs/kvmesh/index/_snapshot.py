"""Prefix-index snapshot format, shared by the numpy and the native implementation.

``MAGIC "KVMIDX01" | u32 LE header length | JSON header {"nwords", "slots", "n"} | n keys (u64 LE) |
n x nwords mask words (u64 LE)``: entry ``i`` is held by worker slot ``s`` iff bit ``s % 64`` of word
``s // 64`` of row ``i`` is set; ``slots[s]`` is that slot's worker name (``None`` for a free slot).
"""

from __future__ import annotations

import json
import struct
import sys

import numpy as np

MAGIC = b"KVMIDX01"


def _le(buf: bytes) -> bytes:
    if sys.byteorder == "little":
        return buf
    return np.frombuffer(buf, dtype=np.uint64).astype("<u8").tobytes()


def encode(names: list[str | None], nwords: int, keys: bytes, masks: bytes) -> bytes:
    """Snapshot bytes from native-endian ``keys`` (n x u64) and ``masks`` (n x nwords u64)."""
    n = len(keys) // 8
    if len(masks) != 8 * n * nwords:
        raise ValueError("masks must hold n x nwords words")
    header = json.dumps({"nwords": nwords, "slots": names, "n": n}).encode()
    return b"".join([MAGIC, struct.pack("<I", len(header)), header, _le(keys), _le(masks)])


def decode(data: bytes) -> tuple[list[str | None], int, bytes, bytes]:
    """(slot names, nwords, keys, masks) with keys/masks as native-endian u64 bytes."""
    if data[: len(MAGIC)] != MAGIC:
        raise ValueError("not a kvmesh prefix-index snapshot")
    off = len(MAGIC)
    (hlen,) = struct.unpack_from("<I", data, off)
    off += 4
    header = json.loads(data[off : off + hlen])
    off += hlen
    n, nwords = int(header["n"]), int(header["nwords"])
    end = off + 8 * n * (1 + nwords)
    if len(data) < end or nwords < 1:
        raise ValueError("truncated prefix-index snapshot")
    keys, masks = bytes(data[off : off + 8 * n]), bytes(data[off + 8 * n : end])
    return list(header["slots"]), nwords, _le(keys), _le(masks)
