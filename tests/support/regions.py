"""Tampering with kv-sync regions in tests (the owner's shared memory, written behind its back)."""

from __future__ import annotations

import os

from kvmesh.kvplane.kvsync.tier import SHM_DIR, RegionReader, data_offset


def corrupt_block(shm_name: str, digest: bytes) -> None:
    """Flips one byte of the block's data in the owner's region (TIER_API.md's slot layout)."""
    reader = RegionReader.attach(shm_name)
    try:
        (ref,) = reader.locate([digest])
        assert ref is not None, "block not in the region"
        pos = data_offset(reader.num_slots) + ref.slot * reader.block_bytes + 100
    finally:
        reader.close()
    with open(os.path.join(SHM_DIR, shm_name), "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ 0xFF]))
