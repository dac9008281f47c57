"""kv-sync tier: slot format, leases, LFU+LRU eviction, reuse and corruption detection (one process)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kvmesh.kvplane.kvsync import tier
from kvmesh.kvplane.kvsync.tier import (
    CorruptBlock,
    RegionReader,
    SlotRef,
    StaleBlock,
    TierRegion,
    data_offset,
    segment_bytes,
)

BLOCK = 4096
LAYOUT = "tiny-llama|bfloat16|bs32|vllm-cpu"


def _digest(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def _data(i: int, n: int = BLOCK) -> bytes:
    return bytes((i * 7 + k) % 251 for k in range(n))


@pytest.fixture
def region() -> Iterator[TierRegion]:
    r = TierRegion.create(f"kvmesh-ut-{os.getpid()}-{os.urandom(4).hex()}", BLOCK, 4, LAYOUT)
    yield r
    r.close()


@pytest.fixture
def reader(region: TierRegion) -> Iterator[RegionReader]:
    rd = RegionReader.attach(region.shm_name)
    yield rd
    rd.close()


def test_layout_offsets_are_page_aligned() -> None:
    assert data_offset(4) % 4096 == 0
    assert data_offset(1000) >= 4096 + 1000 * 72
    assert segment_bytes(BLOCK, 4) == data_offset(4) + 4 * BLOCK


def test_put_get_locate_and_reader_copy(region: TierRegion, reader: RegionReader) -> None:
    assert region.put(_digest(0), _data(0), now_ns=1)
    assert bytes(region.get(_digest(0), now_ns=2) or b"") == _data(0)
    assert region.contains_prefix([_digest(0), _digest(1), _digest(0)]) == 1
    assert (reader.block_bytes, reader.num_slots, reader.layout) == (BLOCK, 4, LAYOUT)
    (ref,) = reader.locate([_digest(0)])
    assert ref is not None and ref == region.locate([_digest(0)])[0]
    assert ref.generation % 2 == 0 and ref.generation > 0
    out = bytearray(BLOCK)
    assert reader.read_into(ref, _digest(0), memoryview(out)) == BLOCK
    assert bytes(out) == _data(0)
    assert reader.locate([_digest(1)]) == [None]


def test_short_block_keeps_its_length(region: TierRegion, reader: RegionReader) -> None:
    region.put(_digest(0), _data(0, 100), now_ns=1)
    (ref,) = reader.locate([_digest(0)])
    assert ref is not None
    out = bytearray(BLOCK)
    assert reader.read_into(ref, _digest(0), memoryview(out)) == 100
    assert bytes(out[:100]) == _data(0, 100)


def test_invalid_inputs_name_the_field(region: TierRegion) -> None:
    with pytest.raises(InvalidArgument) as e:
        region.put(b"short", _data(0), now_ns=1)
    assert e.value.field == "digest"
    with pytest.raises(InvalidArgument) as e:
        region.put(_digest(0), _data(0, BLOCK + 1), now_ns=1)
    assert e.value.field == "data"
    with pytest.raises(InvalidArgument) as e:
        region.lease([SlotRef(99, 2)], until_ns=10)
    assert e.value.field == "slot"
    with pytest.raises(InvalidArgument) as e:
        TierRegion.create("kvmesh-ut-bad", 0, 4, LAYOUT)
    assert e.value.field == "block_bytes"


def test_eviction_is_lfu_then_lru(region: TierRegion) -> None:
    for i in range(4):
        region.put(_digest(i), _data(i), now_ns=10 + i)
    region.get(_digest(0), now_ns=20)  # 0 has 2 hits; 1, 2, 3 have 1: 1 is the oldest of those
    region.get(_digest(2), now_ns=21)
    assert region.put(_digest(4), _data(4), now_ns=30)
    assert region.drain_evicted() == [_digest(1)]
    assert region.put(_digest(5), _data(5), now_ns=31)  # 3 (1 hit, t=13) goes before 4 (1 hit, t=30)
    assert region.drain_evicted() == [_digest(3)]
    assert region.drain_evicted() == []
    assert region.contains_prefix([_digest(0), _digest(2), _digest(4), _digest(5)]) == 4


def test_leased_slot_is_never_reused(region: TierRegion, reader: RegionReader) -> None:
    for i in range(4):
        region.put(_digest(i), _data(i), now_ns=1)
    refs = [r for r in reader.locate([_digest(i) for i in range(4)]) if r is not None]
    reader.lease(refs, until_ns=100)
    assert not region.put(_digest(9), _data(9), now_ns=50)  # every slot leased: refused
    assert not region.evict(_digest(0), now_ns=50)
    assert region.drain_evicted() == []
    out = bytearray(BLOCK)
    for i, ref in enumerate(refs):
        reader.read_into(ref, _digest(i), memoryview(out))
        assert bytes(out) == _data(i)
    assert region.put(_digest(9), _data(9), now_ns=101)  # expired: reusable again
    assert len(region.drain_evicted()) == 1


def test_partial_lease_evicts_only_unleased(region: TierRegion, reader: RegionReader) -> None:
    for i in range(4):
        region.put(_digest(i), _data(i), now_ns=1 + i)
    (ref0,) = reader.locate([_digest(0)])
    assert ref0 is not None
    reader.lease([ref0], until_ns=1000)
    assert region.lease_until(ref0.slot) == 1000
    reader.lease([ref0], until_ns=500)  # never shortened
    assert region.lease_until(ref0.slot) == 1000
    region.put(_digest(8), _data(8), now_ns=10)
    assert region.drain_evicted() == [_digest(1)]  # 0 is the LFU+LRU victim but leased
    region.put(_digest(9), _data(9), now_ns=2000)  # the lease ended: 0 is the victim again
    assert region.drain_evicted() == [_digest(0)]


def test_reader_detects_reuse(region: TierRegion, reader: RegionReader) -> None:
    region.put(_digest(0), _data(0), now_ns=1)
    (ref,) = reader.locate([_digest(0)])
    assert ref is not None
    region.evict(_digest(0))
    region.put(_digest(1), _data(1), now_ns=2)
    out = memoryview(bytearray(BLOCK))
    with pytest.raises(StaleBlock):
        reader.read_into(ref, _digest(0), out)
    (ref1,) = reader.locate([_digest(1)])
    assert ref1 is not None and reader.locate([_digest(0)]) == [None]
    with pytest.raises(StaleBlock):  # right slot and generation, but the caller asks for another block
        reader.read_into(ref1, _digest(0), out)


def test_reader_detects_reuse_of_same_slot() -> None:
    r = TierRegion.create(f"kvmesh-ut-one-{os.getpid()}", BLOCK, 1, LAYOUT)
    rd = RegionReader.attach(r.shm_name)
    try:
        r.put(_digest(0), _data(0), now_ns=1)
        (ref,) = rd.locate([_digest(0)])
        assert ref is not None
        assert r.put(_digest(1), _data(1), now_ns=2)  # the one slot is reused
        (new,) = rd.locate([_digest(1)])
        assert new is not None and new.slot == ref.slot and new.generation > ref.generation
        with pytest.raises(StaleBlock):
            rd.read_into(ref, _digest(0), memoryview(bytearray(BLOCK)))
        with pytest.raises(StaleBlock):  # a lease taken on the old generation is refused
            rd.lease([ref], until_ns=10)
    finally:
        rd.close()
        r.close()


def test_write_in_progress_is_stale(region: TierRegion, reader: RegionReader) -> None:
    region.put(_digest(0), _data(0), now_ns=1)
    (ref,) = reader.locate([_digest(0)])
    assert ref is not None
    region._gen[ref.slot] += 1  # the owner is mid-write (odd generation)
    with pytest.raises(StaleBlock):
        reader.read_into(ref, _digest(0), memoryview(bytearray(BLOCK)))


def test_corrupt_byte_is_detected(region: TierRegion, reader: RegionReader) -> None:
    region.put(_digest(0), _data(0), now_ns=1)
    view = region.get(_digest(0), now_ns=2)
    assert view is not None
    view[17] ^= 0x40  # a bit flips in memory after the CRC was computed
    del view
    (ref,) = reader.locate([_digest(0)])
    assert ref is not None
    out = memoryview(bytearray(BLOCK))
    with pytest.raises(CorruptBlock) as e:
        reader.read_into(ref, _digest(0), out)
    assert isinstance(e.value, FailedPrecondition) and "CRC32C" in e.value.message
    assert reader.read_into(ref, _digest(0), out, verify=False) == BLOCK


def test_layout_mismatch_and_missing_region_refused(region: TierRegion) -> None:
    with pytest.raises(FailedPrecondition, match="layout mismatch"):
        RegionReader.attach(region.shm_name, expect_layout="other-model|float16|bs16")
    RegionReader.attach(region.shm_name, expect_layout=LAYOUT).close()
    with pytest.raises(NotFound):
        RegionReader.attach("kvmesh-ut-no-such-region")


def test_reader_cache_follows_epoch(region: TierRegion, reader: RegionReader) -> None:
    region.put(_digest(0), _data(0), now_ns=1)
    assert reader.locate([_digest(0)])[0] is not None
    epoch = reader.epoch
    assert reader.locate([_digest(0)])[0] is not None and reader.epoch == epoch
    region.evict(_digest(0))
    assert reader.epoch > epoch
    assert reader.locate([_digest(0)]) == [None]


def test_a_dead_owners_region_is_removed_when_a_region_is_created(tmp_path: Path) -> None:
    """An owner killed with SIGKILL cannot unlink its region: the next create on the host removes it."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(child.stdout)  # exited: its pid names no process (unless reused in between, then kept: safe)
    orphan = tmp_path / tier.region_name("abc", pid=dead)
    mine = tmp_path / tier.region_name("def")
    other = tmp_path / "psm_1234"  # not a kvmesh region: never touched
    for f in (orphan, mine, other):
        f.write_bytes(b"x")
    removed = tier.remove_orphans(str(tmp_path))
    assert removed == [orphan.name] or (removed == [] and tier._alive(dead))
    assert mine.exists() and other.exists()
    region = TierRegion.create(tier.region_name("new"), 64, 2, "layout")  # create sweeps /dev/shm
    try:
        assert region.shm_name.startswith(f"kvmesh-{os.getpid()}-")
    finally:
        region.close()


def _fill(res: tier.Reservation, data: bytes) -> int:
    """Writes `data` into the reserved slot as a receive copy would, returning the CRC32C of its pass."""
    return tier.copy_checksum(res.data[: len(data)], memoryview(data))


def test_reserve_publish_round_trip(region: TierRegion, reader: RegionReader) -> None:
    res = region.reserve(_digest(0), now_ns=1)
    assert res is not None and len(res.data) == BLOCK
    crc = _fill(res, _data(0, 1000))
    epoch = region.epoch
    ref = region.publish(res, 1000, crc, now_ns=2)
    assert ref.generation % 2 == 0 and region.epoch > epoch
    assert region.locate([_digest(0)]) == [ref] == reader.locate([_digest(0)])
    out = bytearray(BLOCK)
    assert reader.read_checked(ref, _digest(0), memoryview(out)) == (1000, tier.checksum(_data(0, 1000)))
    assert bytes(out[:1000]) == _data(0, 1000)
    assert len(region) == 1 and bytes(region.get(_digest(0), now_ns=3) or b"") == _data(0, 1000)
    with pytest.raises(FailedPrecondition):  # a reservation is published once
        region.publish(res, 1000, crc, now_ns=4)


def test_published_crc_is_the_writers_so_a_wrong_one_is_caught(region: TierRegion, reader: RegionReader) -> None:
    res = region.reserve(_digest(0), now_ns=1)
    assert res is not None
    crc = _fill(res, _data(0))
    ref = region.publish(res, BLOCK, crc ^ 1, now_ns=2)  # stored as given, not recomputed
    with pytest.raises(CorruptBlock):
        reader.read_into(ref, _digest(0), memoryview(bytearray(BLOCK)))


def test_a_reader_never_sees_a_reserved_unpublished_slot(region: TierRegion, reader: RegionReader) -> None:
    assert region.put(_digest(0), _data(0), now_ns=1)
    old = reader.locate([_digest(0)])[0]
    assert old is not None
    for i in range(1, 4):
        assert region.put(_digest(i), _data(i), now_ns=1 + i)
    res = region.reserve(_digest(9), now_ns=10)  # full: evicts block 0 (LRU), its slot now being written
    assert res is not None and res.slot == old.slot
    _fill(res, _data(9))  # the data is all there, but unpublished
    assert reader.locate([_digest(9), _digest(0)]) == [None, None]
    assert region.locate([_digest(9)]) == [None] and region.contains_prefix([_digest(9)]) == 0
    with pytest.raises(StaleBlock):  # an old ref to the slot fails too
        reader.read_into(old, _digest(0), memoryview(bytearray(BLOCK)))
    with pytest.raises(StaleBlock):  # and a ref guessed at the odd generation
        reader.read_into(SlotRef(res.slot, old.generation + 1), _digest(9), memoryview(bytearray(BLOCK)))
    assert region.drain_evicted() == [_digest(0)]


def test_abort_frees_the_slot_and_bumps_its_generation(region: TierRegion, reader: RegionReader) -> None:
    assert region.put(_digest(0), _data(0), now_ns=1)
    old = reader.locate([_digest(0)])[0]
    assert old is not None and region.evict(_digest(0))
    res = region.reserve(_digest(5), now_ns=2)
    assert res is not None
    _fill(res, _data(5))
    region.abort(res)
    assert reader.locate([_digest(5), _digest(0)]) == [None, None]
    assert int(reader._gen[res.slot]) % 2 == 0 and int(reader._gen[res.slot]) > old.generation
    with pytest.raises(FailedPrecondition):
        region.publish(res, BLOCK, 0, now_ns=3)  # aborted: publishing it is refused
    for i in range(4):  # every slot, the aborted one too, is free again
        assert region.put(_digest(10 + i), _data(i), now_ns=4 + i)
    assert region.contains_prefix([_digest(10 + i) for i in range(4)]) == 4


def test_reserve_never_takes_a_leased_or_reserved_slot(region: TierRegion, reader: RegionReader) -> None:
    for i in range(3):
        assert region.put(_digest(i), _data(i), now_ns=1 + i)
    refs = region.locate([_digest(i) for i in range(3)])
    region.lease([r for r in refs if r is not None], until_ns=1_000)
    first = region.reserve(_digest(7), now_ns=10)  # the one free slot
    assert first is not None and first.slot not in {r.slot for r in refs if r is not None}
    assert region.reserve(_digest(8), now_ns=10) is None  # three leased, one reserved
    assert not region.put(_digest(8), _data(8), now_ns=10)
    assert region.contains_prefix([_digest(i) for i in range(3)]) == 3
    region.publish(first, BLOCK, _fill(first, _data(7)), now_ns=11)
    second = region.reserve(_digest(8), now_ns=2_000)  # leases over: the LFU+LRU victim, block 0
    assert second is not None and refs[0] is not None and second.slot == refs[0].slot
    region.abort(second)


def test_publish_of_a_digest_stored_meanwhile_keeps_the_stored_copy(region: TierRegion) -> None:
    a = region.reserve(_digest(0), now_ns=1)
    b = region.reserve(_digest(0), now_ns=1)  # two pulls of one block, concurrently
    assert a is not None and b is not None and a.slot != b.slot
    ref = region.publish(a, BLOCK, _fill(a, _data(0)), now_ns=2)
    assert region.publish(b, BLOCK, _fill(b, _data(0)), now_ns=3) == ref
    assert len(region) == 1
    assert region.put(_digest(1), _data(1), now_ns=4) and region.put(_digest(2), _data(2), now_ns=5)
    assert region.put(_digest(3), _data(3), now_ns=6)  # b's slot was freed: four blocks fit
    assert len(region) == 4


# The block length at its edges: a block is 1..block_bytes bytes. An empty block is refused (naming the field),
# by `put` and by `publish` alike; one byte and exactly block_bytes are stored whole.


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
    res = region.reserve(_digest(10 + length), now_ns=1)
    assert res is not None
    data = bytes((5 * k + 1) % 251 for k in range(length))
    res.data[:length] = data
    ref = region.publish(res, length, tier.checksum(data), now_ns=2)
    out = bytearray(BLOCK)
    assert reader.read_into(ref, _digest(10 + length), memoryview(out)) == length
    assert bytes(out[:length]) == data
