"""The shared-memory tier at its edges: the segment layout a one-sided reader relies on (offsets, header fields,
the page-aligned data area), each argument's bounds and the field its error names, the lease instant (a lease
ending at `now` no longer protects a slot), and the foreign segments a reader must refuse."""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.core.errors import FailedPrecondition, InvalidArgument, NotFound
from kvmesh.kvplane.kvsync import tier
from kvmesh.kvplane.kvsync.tier import (
    HEADER_BYTES,
    MAGIC,
    MAX_LAYOUT_BYTES,
    REGION_ID_BYTES,
    SLOT_HEADER_BYTES,
    VERSION,
    RegionReader,
    SlotRef,
    StaleBlock,
    TierRegion,
    data_offset,
    iter_slot_headers,
    segment_bytes,
    slot_data_offset,
    slot_header_offset,
)

pytestmark = pytest.mark.unit

BLOCK = 256
LAYOUT = "edge-model|bfloat16|bs16|vllm-cpu"


def _digest(i: int) -> bytes:
    return hashlib.sha256(f"edge-{i}".encode()).digest()


def _data(i: int, n: int = BLOCK) -> bytes:
    return bytes((i * 11 + k) % 251 for k in range(n))


def _name(tag: str) -> str:
    return f"kvmesh-ut-edges-{os.getpid()}-{tag}-{os.urandom(3).hex()}"


@pytest.fixture
def region() -> Iterator[TierRegion]:
    r = TierRegion.create(_name("r"), BLOCK, 4, LAYOUT)
    yield r
    r.close()


@pytest.fixture
def reader(region: TierRegion) -> Iterator[RegionReader]:
    rd = RegionReader.attach(region.shm_name)
    yield rd
    rd.close()


# --- the segment layout (module docstring): what a peer reading the bytes one-sided relies on


def test_the_data_area_starts_at_the_first_page_after_headers_and_leases() -> None:
    assert data_offset(1) == 8192  # 4096 + 72 rounds up to the next page
    assert data_offset(56) == 8192  # 4096 + 56 * 72 = 8128
    assert data_offset(57) == 12288  # 4096 + 57 * 72 = 8200
    assert data_offset(512) == 40960  # 4096 + 512 * 72 = 40960 exactly: no extra page
    assert segment_bytes(100, 3) == 8192 + 300
    assert slot_header_offset(0) == HEADER_BYTES and slot_header_offset(5) == HEADER_BYTES + 5 * 64
    assert slot_data_offset(100, 3, 0) == 8192 and slot_data_offset(100, 3, 2) == 8192 + 200


def test_the_region_header_holds_magic_version_sizes_epoch_id_and_layout(region: TierRegion) -> None:
    seg = bytes(region.segment[:HEADER_BYTES])
    magic, version, block_bytes, num_slots, epoch, layout_len = struct.unpack_from("<4sIQQQI", seg)
    assert (magic, version, block_bytes, num_slots, epoch) == (MAGIC, VERSION, BLOCK, 4, 0)
    assert (MAGIC, VERSION) == (b"KVMR", 1)
    assert seg[64 : 64 + layout_len].decode() == LAYOUT and layout_len == len(LAYOUT)
    assert region.region_id == seg[40 : 40 + REGION_ID_BYTES] and len(region.region_id) == 16
    assert region.put(_digest(0), _data(0), now_ns=1)
    assert struct.unpack_from("<Q", region.segment, 24)[0] == region.epoch == 1  # the epoch lives at 24
    assert len(region.segment) == segment_bytes(BLOCK, 4)


def test_two_regions_get_different_random_ids() -> None:
    a, b = TierRegion.create(_name("a"), BLOCK, 1, LAYOUT), TierRegion.create(_name("b"), BLOCK, 1, LAYOUT)
    try:
        assert a.region_id != b.region_id and a.region_id != bytes(REGION_ID_BYTES)
    finally:
        a.close()
        b.close()


def test_a_slot_header_read_out_of_the_segment_names_the_block(region: TierRegion) -> None:
    assert region.put(_digest(3), _data(3, 100), now_ns=1)
    (ref,) = region.locate([_digest(3)])
    assert ref is not None
    start = slot_header_offset(ref.slot)
    ((generation, digest, length, crc),) = iter_slot_headers(region.segment[start : start + SLOT_HEADER_BYTES])
    assert (generation, digest, length, crc) == (ref.generation, _digest(3), 100, tier.checksum(_data(3, 100)))
    begin = slot_data_offset(BLOCK, 4, ref.slot)
    assert bytes(region.segment[begin : begin + 100]) == _data(3, 100)


# --- arguments: bounds, and the field an error names


@pytest.mark.parametrize("num_slots", [0, -1])
def test_a_region_needs_a_slot(num_slots: int) -> None:
    with pytest.raises(InvalidArgument) as e:
        TierRegion.create(_name("n"), BLOCK, num_slots, LAYOUT)
    assert e.value.field == "num_slots" and str(e.value) == f"num_slots: must be > 0, got {num_slots}"


def test_block_bytes_message_names_the_value() -> None:
    with pytest.raises(InvalidArgument) as e:
        TierRegion.create(_name("n"), -3, 1, LAYOUT)
    assert str(e.value) == "block_bytes: must be > 0, got -3"


def test_one_slot_of_one_byte_is_a_region() -> None:
    r = TierRegion.create(_name("one"), 1, 1, "x")
    try:
        assert r.put(_digest(0), b"\x07", now_ns=1) and bytes(r.get(_digest(0), now_ns=2) or b"") == b"\x07"
    finally:
        r.close()


@pytest.mark.parametrize("layout", ["", "x" * (MAX_LAYOUT_BYTES + 1), "é" * 129])  # é is 2 bytes of UTF-8
def test_a_layout_of_0_or_over_256_bytes_is_refused(layout: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        TierRegion.create(_name("l"), BLOCK, 1, layout)
    n = len(layout.encode())
    assert e.value.field == "layout" and str(e.value) == f"layout: must be 1..256 bytes of UTF-8, got {n}"


@pytest.mark.parametrize("layout", ["x", "y" * MAX_LAYOUT_BYTES, "é" * 128])
def test_a_layout_of_1_to_256_bytes_is_kept_and_read_back(layout: str) -> None:
    r = TierRegion.create(_name("l"), BLOCK, 1, layout)
    try:
        rd = RegionReader.attach(r.shm_name, expect_layout=layout)
        assert rd.layout == layout == r.layout
        rd.close()
    finally:
        r.close()


def test_a_digest_must_be_32_bytes(region: TierRegion) -> None:
    for bad in (b"", bytes(31), bytes(33)):
        with pytest.raises(InvalidArgument) as e:
            region.reserve(bad, now_ns=1)
        assert str(e.value) == f"digest: must be 32 bytes, got {len(bad)}"
    assert region.put(bytes(32), _data(0), now_ns=1)


def test_data_and_length_messages_name_the_bounds(region: TierRegion) -> None:
    with pytest.raises(InvalidArgument) as e:
        region.put(_digest(0), _data(0, BLOCK + 1), now_ns=1)
    assert str(e.value) == f"data: must be 1..{BLOCK} bytes, got {BLOCK + 1}"
    res = region.reserve(_digest(0), now_ns=1)
    assert res is not None
    with pytest.raises(InvalidArgument) as e:
        region.publish(res, 0, 0, now_ns=2)
    assert str(e.value) == f"length: must be 1..{BLOCK}, got 0"
    region.abort(res)


@pytest.mark.parametrize("slot", [-1, 4])
def test_a_slot_outside_the_region_is_refused_everywhere(region: TierRegion, slot: int) -> None:
    for call in (
        lambda: region.lease([SlotRef(slot, 2)], until_ns=10),
        lambda: region.lease_until(slot),
        lambda: region.view(SlotRef(slot, 2), _digest(0)),
    ):
        with pytest.raises(InvalidArgument) as e:
            call()
        assert str(e.value) == f"slot: must be in [0, 4), got {slot}"
    with pytest.raises(InvalidArgument) as e:
        region.release_leases([0, slot], held_ns=10, until_ns=[0, 0])
    assert str(e.value) == "slots: must be in [0, 4)"


def test_the_first_and_last_slots_are_in_range(region: TierRegion) -> None:
    assert region.lease_until(0) == 0 and region.lease_until(3) == 0  # never leased
    assert region.release_leases([0, 3], held_ns=10, until_ns=[0, 0]) == 0
    assert region.release_leases([], held_ns=10, until_ns=[]) == 0


def test_a_read_needs_room_for_the_whole_block(region: TierRegion, reader: RegionReader) -> None:
    assert region.put(_digest(0), _data(0, 100), now_ns=1)
    (ref,) = reader.locate([_digest(0)])
    assert ref is not None
    with pytest.raises(InvalidArgument) as e:
        reader.read_into(ref, _digest(0), memoryview(bytearray(99)))
    assert str(e.value) == "out: needs 100 bytes, got 99"
    out = bytearray(100)
    assert reader.read_checked(ref, _digest(0), memoryview(out)) == (100, tier.checksum(_data(0, 100)))
    assert bytes(out) == _data(0, 100)


# --- leases: the instant a lease ends, never shortening, releasing


def _fill_and_lease(region: TierRegion, until_ns: int) -> list[SlotRef]:
    for i in range(4):
        assert region.put(_digest(i), _data(i), now_ns=1 + i)
    refs = [r for r in region.locate([_digest(i) for i in range(4)]) if r is not None]
    region.lease(refs, until_ns=until_ns)
    return refs


def test_a_lease_protects_a_slot_until_the_instant_it_ends(region: TierRegion) -> None:
    _fill_and_lease(region, until_ns=100)
    assert region.leased(_digest(0), now_ns=99) and not region.leased(_digest(0), now_ns=100)
    assert not region.leased(_digest(9), now_ns=0)  # a block not held is not leased
    assert not region.put(_digest(9), _data(9), now_ns=99)
    assert region.reserve(_digest(9), now_ns=99) is None
    assert not region.evict(_digest(0), now_ns=99)
    assert region.put(_digest(9), _data(9), now_ns=100)  # the lease ended at 100: the slot is reusable
    assert region.drain_evicted() == [_digest(0)]
    assert region.evict(_digest(1), now_ns=100)


def test_evict_without_a_time_ignores_leases_and_an_absent_block_is_not_evicted(region: TierRegion) -> None:
    _fill_and_lease(region, until_ns=100)
    assert region.evict(_digest(2))
    assert not region.evict(_digest(2)) and not region.evict(_digest(9), now_ns=1)
    assert region.contains_prefix([_digest(2)]) == 0 and len(region) == 3
    assert region.drain_evicted() == [_digest(2)]


def test_a_lease_is_never_shortened_and_an_equal_one_changes_nothing(region: TierRegion) -> None:
    (ref, *_) = _fill_and_lease(region, until_ns=100)
    region.lease([ref], until_ns=100)
    region.lease([ref], until_ns=99)
    assert region.lease_until(ref.slot) == 100
    region.lease([ref], until_ns=101)
    assert region.lease_until(ref.slot) == 101


def test_release_lowers_only_the_leases_still_at_the_held_instant(region: TierRegion) -> None:
    refs = _fill_and_lease(region, until_ns=100)
    region.lease([refs[1]], until_ns=200)  # extended by a later lease: stays
    slots = [r.slot for r in refs]
    # slot 0 lowered to 50, slot 1 kept (held elsewhere to 200), slot 2 "lowered" to 100 (not lower: kept),
    # slot 3 lowered to 0 (no other lease)
    assert region.release_leases(slots, held_ns=100, until_ns=[50, 50, 100, 0]) == 2
    assert [region.lease_until(s) for s in slots] == [50, 200, 100, 0]
    assert region.release_leases(slots, held_ns=100, until_ns=[0, 0, 0, 0]) == 1  # only slot 2 still at 100
    assert [region.lease_until(s) for s in slots] == [50, 200, 0, 0]


# --- eviction order through touches


def test_a_touch_with_an_older_clock_never_moves_a_blocks_last_use_back(region: TierRegion) -> None:
    for i, t in enumerate((10, 20, 30, 40)):
        assert region.put(_digest(i), _data(i), now_ns=t)
    assert region.get(_digest(1), now_ns=5) is not None  # last use of 1 stays 20
    assert region.get(_digest(0), now_ns=15) is not None  # last use of 0 becomes 15
    for i in (2, 3):
        assert region.get(_digest(i), now_ns=50) is not None
    assert region.put(_digest(9), _data(9), now_ns=60)  # all at 2 hits: 0 (last 15) is older than 1 (20)
    assert region.drain_evicted() == [_digest(0)]


def test_lfu_lru_order_holds_after_many_touches(region: TierRegion) -> None:
    for i in range(4):
        assert region.put(_digest(i), _data(i), now_ns=i)
    t = 10
    for _ in range(60):  # far more touches than slots: the order's bookkeeping is compacted on the way
        for i in (0, 1, 3):
            t += 1
            assert region.get(_digest(i), now_ns=t) is not None
    assert region.put(_digest(9), _data(9), now_ns=t + 1)
    assert region.drain_evicted() == [_digest(2)]  # 1 hit against 61
    assert region.get(_digest(9), now_ns=t + 2) is not None  # 2 hits: still the fewest
    assert region.put(_digest(10), _data(10), now_ns=t + 3)
    assert region.drain_evicted() == [_digest(9)]
    assert region.contains_prefix([_digest(0), _digest(1), _digest(3), _digest(10)]) == 4


def test_get_of_an_absent_block_is_none_and_counts_nothing(region: TierRegion) -> None:
    assert region.get(_digest(5), now_ns=1) is None
    assert region.locate([_digest(5)]) == [None] and len(region) == 0


# --- the slot's view and its generation


def test_a_view_is_refused_at_an_odd_generation_or_an_empty_slot(region: TierRegion) -> None:
    assert region.put(_digest(0), _data(0), now_ns=1)
    (ref,) = region.locate([_digest(0)])
    assert ref is not None
    data, crc = region.view(ref, _digest(0))
    assert bytes(data) == _data(0) and crc == tier.checksum(_data(0))
    del data
    with pytest.raises(StaleBlock, match=f"no longer holds generation {ref.generation - 1}"):
        region.view(SlotRef(ref.slot, ref.generation - 1), _digest(0))
    assert region.evict(_digest(0))
    with pytest.raises(StaleBlock):  # freed: even generation again, but nothing in it
        region.view(SlotRef(ref.slot, ref.generation + 2), _digest(0))
    assert not region.unchanged(ref)


def test_abort_leaves_the_generation_two_past_the_block_it_held(region: TierRegion) -> None:
    for i in range(4):
        assert region.put(_digest(i), _data(i), now_ns=1 + i)
    (ref,) = region.locate([_digest(0)])
    assert ref is not None
    res = region.reserve(_digest(9), now_ns=10)  # full: block 0's slot
    assert res is not None and res.slot == ref.slot and int(region._gen[ref.slot]) == ref.generation + 1
    region.abort(res)
    assert int(region._gen[ref.slot]) == ref.generation + 2
    with pytest.raises(FailedPrecondition, match="is not reserved by this reservation"):
        region.abort(res)


def test_close_without_unlink_keeps_the_region_for_readers() -> None:
    r = TierRegion.create(_name("keep"), BLOCK, 2, LAYOUT)
    assert r.put(_digest(0), _data(0), now_ns=1)
    res = r.reserve(_digest(1), now_ns=2)
    assert res is not None
    r.close(unlink=False)  # the open reservation ends unpublished
    with pytest.raises(ValueError):
        res.data[0] = 1
    rd = RegionReader.attach(r.shm_name)
    try:
        (ref, missing) = rd.locate([_digest(0), _digest(1)])
        assert ref is not None and missing is None
        out = bytearray(BLOCK)
        assert rd.read_into(ref, _digest(0), memoryview(out)) == BLOCK and bytes(out) == _data(0)
    finally:
        rd.close()
        os.unlink(os.path.join(tier.SHM_DIR, r.shm_name))
    with pytest.raises(NotFound):
        RegionReader.attach(r.shm_name)


# --- foreign segments a reader refuses


@pytest.fixture
def foreign() -> Iterator[Path]:
    path = Path(tier.SHM_DIR) / _name("foreign")
    yield path
    path.unlink(missing_ok=True)


def _header(magic: bytes = MAGIC, version: int = VERSION, layout_len: int = 1, num_slots: int = 1) -> bytes:
    head = struct.pack("<4sIQQQI", magic, version, BLOCK, num_slots, 0, layout_len)
    return head.ljust(64, b"\0") + b"x"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "is not a kv-sync region (empty)"),
        (b"KVMR".ljust(HEADER_BYTES - 1, b"\0"), "is not a kv-sync region (too small)"),
        (_header(magic=b"KVMX").ljust(HEADER_BYTES, b"\0"), "is not a kv-sync region of version 1"),
        (_header(version=2).ljust(HEADER_BYTES, b"\0"), "is not a kv-sync region of version 1"),
        (_header(layout_len=MAX_LAYOUT_BYTES + 1).ljust(HEADER_BYTES, b"\0"), "is not a kv-sync region of version 1"),
        (_header().ljust(segment_bytes(BLOCK, 1) - 1, b"\0"), "is shorter than its header says"),
    ],
    ids=["empty", "too-small", "magic", "version", "layout-len", "short"],
)
def test_a_foreign_segment_is_refused_as_a_failed_precondition(foreign: Path, content: bytes, message: str) -> None:
    foreign.write_bytes(content)
    with pytest.raises(FailedPrecondition) as e:
        RegionReader.attach(foreign.name)
    assert message in e.value.message and foreign.name in e.value.message


def test_a_segment_exactly_as_long_as_its_header_says_attaches(foreign: Path) -> None:
    foreign.write_bytes(_header(layout_len=MAX_LAYOUT_BYTES).ljust(segment_bytes(BLOCK, 1), b"\0"))
    rd = RegionReader.attach("/" + foreign.name)  # a leading slash names the same segment
    try:
        assert (rd.block_bytes, rd.num_slots, len(rd.layout)) == (BLOCK, 1, MAX_LAYOUT_BYTES)
        assert rd.shm_name == foreign.name and rd.locate([_digest(0)]) == [None]
    finally:
        rd.close()


def test_a_missing_region_is_not_found_naming_it() -> None:
    with pytest.raises(NotFound, match="no kv-sync region 'kvmesh-ut-edges-none' on this host"):
        RegionReader.attach("kvmesh-ut-edges-none")


def test_a_layout_mismatch_names_both_layouts(region: TierRegion) -> None:
    with pytest.raises(FailedPrecondition) as e:
        RegionReader.attach(region.shm_name, expect_layout="other")
    assert e.value.message == (f"layout mismatch: region {region.shm_name!r} holds {LAYOUT!r}, expected 'other'")


# --- region names and orphans


def test_a_region_name_carries_the_owner_pid() -> None:
    assert tier.region_name("t") == f"kvmesh-{os.getpid()}-t"
    assert tier.region_name("t", pid=7) == "kvmesh-7-t"


def test_orphans_in_a_missing_folder_are_none(tmp_path: Path) -> None:
    assert tier.remove_orphans(str(tmp_path / "absent")) == []


def test_a_live_process_owned_by_anyone_is_alive() -> None:
    assert tier._alive(os.getpid()) and tier._alive(1)


# --- what a second pass over the survivors pinned: the lease array's layout, epochs never going back, unmapping


def test_the_lease_array_follows_the_slot_headers_as_little_endian_u64(region: TierRegion) -> None:
    refs = _fill_and_lease(region, until_ns=0x0102030405060708)
    base = HEADER_BYTES + 4 * SLOT_HEADER_BYTES
    for ref in refs:
        assert struct.unpack_from("<Q", region.segment, base + 8 * ref.slot)[0] == 0x0102030405060708


def test_putting_a_held_block_again_only_touches_it(region: TierRegion) -> None:
    assert region.put(_digest(0), _data(0), now_ns=1)
    assert region.put(_digest(0), _data(1), now_ns=2)  # held already: True, the stored bytes unchanged
    assert len(region) == 1 and bytes(region.get(_digest(0), now_ns=3) or b"") == _data(0)


def test_a_readers_cache_drops_a_victim_a_reservation_evicted_even_when_it_is_aborted(
    region: TierRegion, reader: RegionReader
) -> None:
    for i in range(4):
        assert region.put(_digest(i), _data(i), now_ns=1 + i)
    assert reader.locate([_digest(0)])[0] is not None  # cached at this epoch
    epoch = region.epoch
    res = region.reserve(_digest(9), now_ns=10)  # evicts block 0
    assert res is not None
    region.abort(res)
    assert region.epoch > epoch  # never back to a value a reader cached
    assert reader.locate([_digest(0)]) == [None]


def test_a_block_moved_to_another_slot_is_located_there() -> None:
    r = TierRegion.create(_name("move"), BLOCK, 2, LAYOUT)
    rd = RegionReader.attach(r.shm_name)
    try:
        assert r.put(_digest(0), _data(0), now_ns=1) and r.put(_digest(1), _data(1), now_ns=2)
        (old,) = rd.locate([_digest(1)])
        assert old is not None
        assert r.evict(_digest(0)) and r.evict(_digest(1))
        assert r.put(_digest(2), _data(2), now_ns=3) and r.put(_digest(1), _data(1), now_ns=4)
        (moved,) = r.locate([_digest(1)])
        assert moved is not None and moved.slot != old.slot
        assert rd.locate([_digest(1), _digest(0)]) == [moved, None]
    finally:
        rd.close()
        r.close()


def test_a_lease_on_a_reused_slot_names_the_slot() -> None:
    r = TierRegion.create(_name("stale"), BLOCK, 1, LAYOUT)
    try:
        assert r.put(_digest(0), _data(0), now_ns=1)
        (ref,) = r.locate([_digest(0)])
        assert ref is not None and r.put(_digest(1), _data(1), now_ns=2)
        with pytest.raises(StaleBlock) as e:
            r.lease([ref], until_ns=10)
        assert e.value.message == f"slot {ref.slot} was reused before its lease took hold"
    finally:
        r.close()


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(name in line for line in maps)


def test_closing_unmaps_the_segment_on_both_sides() -> None:
    r = TierRegion.create(_name("unmap"), BLOCK, 2, LAYOUT)
    rd = RegionReader.attach(r.shm_name)
    assert r.put(_digest(0), _data(0), now_ns=1) and rd.locate([_digest(0)])[0] is not None
    assert _mapped(r.shm_name)
    rd.close()
    r.close()
    assert not _mapped(r.shm_name)
    with pytest.raises(AttributeError):
        r.segment  # noqa: B018 - the owner's views are gone with the mapping


def test_a_pid_no_process_can_have_is_dead() -> None:
    assert not tier._alive(2**30)  # above Linux's PID_MAX_LIMIT (2^22)


def test_an_orphan_removed_by_someone_else_first_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / tier.region_name("gone", pid=2**30)).write_bytes(b"x")

    def raced(path: str) -> None:
        raise FileNotFoundError(path)

    monkeypatch.setattr(tier.os, "unlink", raced)
    assert tier.remove_orphans(str(tmp_path)) == []


def test_a_lease_over_many_slots_extends_each_and_a_stale_one_still_leases_the_others(region: TierRegion) -> None:
    refs = _fill_and_lease(region, until_ns=100)
    region.lease([refs[2]], until_ns=300)
    region.lease(refs, until_ns=200)  # every slot to 200, except the one already leased further
    assert [region.lease_until(r.slot) for r in refs] == [200, 200, 300, 200]
    moved = SlotRef(refs[1].slot, refs[1].generation + 2)  # a generation the slot does not hold
    with pytest.raises(StaleBlock) as e:
        region.lease([refs[0], moved, refs[3]], until_ns=400)
    assert e.value.message == f"slot {moved.slot} was reused before its lease took hold"
    assert [region.lease_until(r.slot) for r in refs] == [400, 400, 300, 400]


def test_headers_read_back_to_back_parse_as_each_one_alone(region: TierRegion) -> None:
    for i in range(3):
        assert region.put(_digest(i), _data(i, BLOCK - i), now_ns=1 + i)
    refs = [r for r in region.locate([_digest(i) for i in range(3)]) if r is not None]
    raw = b"".join(
        bytes(region.segment[slot_header_offset(r.slot) : slot_header_offset(r.slot) + SLOT_HEADER_BYTES]) for r in refs
    )
    alone = [struct.unpack_from("<Q32sII", raw, i * SLOT_HEADER_BYTES) for i in range(3)]
    assert list(iter_slot_headers(raw)) == alone
    assert [(g, d, n) for g, d, n, _ in alone] == [(r.generation, _digest(i), BLOCK - i) for i, r in enumerate(refs)]


def test_a_reader_lists_what_is_published_and_counts_writes_under_way(region: TierRegion, reader: RegionReader) -> None:
    assert reader.published() == [] and reader.writes_under_way() == 0
    for i in range(3):
        assert region.put(_digest(i), _data(i), now_ns=1 + i)
    listed = reader.published()
    assert {d for d, _ in listed} == {_digest(i) for i in range(3)}
    assert [ref.slot for _, ref in listed] == sorted(ref.slot for _, ref in listed)  # in slot order
    assert all(reader.generation(ref.slot) == ref.generation and ref.generation % 2 == 0 for _, ref in listed)
    res = region.reserve(_digest(9), now_ns=10)
    assert res is not None
    assert reader.writes_under_way() == 1 and reader.generation(res.slot) % 2 == 1
    assert _digest(9) not in [d for d, _ in reader.published()]
    region.abort(res)
    assert reader.writes_under_way() == 0
    with pytest.raises(InvalidArgument, match="slot"):
        reader.generation(4)
