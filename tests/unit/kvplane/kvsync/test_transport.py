"""Which transport a kv-sync pull tries first (a pure choice: what both sides offer, and the flag), and the
pieces of a Mooncake batch read: adjacent reads merged, slot headers found where the region keeps them."""

from __future__ import annotations

import hashlib
import os

import pytest

from kvmesh.core.errors import InvalidArgument
from kvmesh.kvplane.kvsync.mooncake import MAX_PIECE_BYTES, coalesce
from kvmesh.kvplane.kvsync.tier import (
    SLOT_HEADER_BYTES,
    TierRegion,
    checksum,
    iter_slot_headers,
    slot_data_offset,
    slot_header_offset,
)
from kvmesh.kvplane.kvsync.transport import offered, transport_order

pytestmark = pytest.mark.unit

ALL = ["shm", "mooncake", "grpc"]


@pytest.mark.parametrize(
    ("choice", "peer_offers", "shm_attaches", "mooncake_here", "order"),
    [
        ("auto", ALL, True, True, ["shm", "mooncake", "grpc"]),  # same host: shared memory first
        ("auto", ALL, False, True, ["mooncake", "grpc"]),  # another host, both run TE
        ("auto", ALL, False, False, ["grpc"]),  # no TE here
        ("auto", ["shm", "grpc"], False, True, ["grpc"]),  # the peer does not offer Mooncake
        ("auto", [], True, True, ["shm", "grpc"]),  # an older peer: shm and grpc
        ("mooncake", ALL, True, True, ["mooncake", "grpc"]),  # named: that one, then grpc
        ("mooncake", ["shm", "grpc"], True, True, ["grpc"]),
        ("shm", ALL, False, True, ["grpc"]),  # the region does not attach here
        ("grpc", ALL, True, True, ["grpc"]),
    ],
)
def test_transport_order_is_the_best_both_sides_offer_then_grpc(
    choice: str, peer_offers: list[str], shm_attaches: bool, mooncake_here: bool, order: list[str]
) -> None:
    assert transport_order(choice, peer_offers, shm_attaches, mooncake_here) == order


def test_a_server_offers_mooncake_only_when_its_engine_runs_and_the_flag_allows() -> None:
    assert offered("auto", True) == ALL
    assert offered("mooncake", True) == ALL
    assert offered("grpc", True) == offered("shm", True) == offered("auto", False) == ["shm", "grpc"]


def test_an_unknown_transport_is_invalid_argument_naming_the_field() -> None:
    with pytest.raises(InvalidArgument) as err:
        transport_order("rdma", ALL, True, True)
    assert err.value.field == "transport"
    with pytest.raises(InvalidArgument) as err:
        offered("tcp", True)
    assert err.value.field == "kvsync_transport"


def test_coalesce_merges_adjacent_reads_on_both_sides_up_to_the_piece_cap() -> None:
    # slot headers (64 B apart) and data (16 KiB apart), interleaved as a pull lists them, slots 0..3 then 9
    local, remote, lengths = [], [], []
    for i, slot in enumerate([0, 1, 2, 3, 9]):
        local += [1000 + i * 64, 900_000 + i * 16384]
        remote += [5000 + slot * 64, 800_000 + slot * 16384]
        lengths += [64, 16384]
    merged = coalesce(local, remote, lengths)
    assert merged == (
        [1000, 1256, 900_000, 965_536],
        [5000, 5576, 800_000, 947_456],
        [256, 64, 65536, 16384],
    )
    # adjacent on the remote side only: not merged (the local pieces are apart)
    assert coalesce([0, 100], [0, 64], [64, 64]) == ([0, 100], [0, 64], [64, 64])
    # a run longer than the cap is split at piece boundaries
    size = MAX_PIECE_BYTES // 2
    got = coalesce([i * size for i in range(5)], [i * size for i in range(5)], [size] * 5)
    assert got[2] == [MAX_PIECE_BYTES, MAX_PIECE_BYTES, size]


def test_slot_headers_and_data_read_at_their_offsets_are_what_the_owner_wrote() -> None:
    """What a one-sided reader on another host sees: the bytes at the header and data offsets of a slot."""
    region = TierRegion.create(f"kvmesh-{os.getpid()}-transport-test", 4096, 4, "test|layout")
    try:
        digest = hashlib.sha256(b"block").digest()
        data = os.urandom(3000)
        assert region.put(digest, data, now_ns=1)
        (ref,) = region.locate([digest])
        assert ref is not None
        raw = region.segment
        header = raw[slot_header_offset(ref.slot) : slot_header_offset(ref.slot) + SLOT_HEADER_BYTES]
        ((generation, got_digest, length, crc),) = iter_slot_headers(header)
        assert (generation, got_digest, length, crc) == (ref.generation, digest, 3000, checksum(data))
        start = slot_data_offset(region.block_bytes, region.num_slots, ref.slot)
        assert bytes(raw[start : start + length]) == data
        del header, raw
    finally:
        region.close()
