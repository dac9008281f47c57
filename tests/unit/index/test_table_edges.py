"""The numpy index's open-addressing table (`kvmesh.index._table`), pinned at the edges its docstring states: the
capacity (a power of two, at least 16), the Fibonacci home slot, linear probing inside the ``WINDOW`` slots from
home (padded at the end: no wrap-around), the overflow dict for a full window, tombstones and their reuse, the
load limit that rebuilds (growing while live keys exceed a quarter of the slots) and the compaction rule."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.index import _table
from kvmesh.index._table import EMPTY, MAX_LOAD, OVERFLOW, TOMB, WINDOW, U64Table, _first_true

pytestmark = pytest.mark.unit

GOLD = 0x9E3779B97F4A7C15
GOLD_INV = pow(GOLD, -1, 1 << 64)


def key_at_home(slot: int, bits: int, salt: int = 0) -> int:
    """A key whose home slot in a table of ``2**bits`` slots is ``slot``: the top ``bits`` bits of key·GOLD."""
    return (((slot << (64 - bits)) + salt) * GOLD_INV) % (1 << 64)


def u64(xs: list[int]) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def i64(xs: list[int]) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


def lookup(table: U64Table, keys: list[int]) -> tuple[list[int], list[int]]:
    e, slots = table.lookup(u64(keys))
    assert e.dtype == np.int64 and slots.dtype == np.int64
    return e.tolist(), slots.tolist()


def test_first_true_finds_the_first_true_of_each_row_of_eight() -> None:
    rows = np.zeros((10, WINDOW), dtype=bool)
    for i in range(WINDOW):
        rows[i, i] = True
        rows[i, WINDOW - 1] = True  # a later True never moves the answer
    rows[8, [2, 5]] = True
    found, first = _first_true(rows)  # row 9: no True
    assert found.tolist() == [True] * 9 + [False]
    assert first.tolist()[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 2]
    assert first.dtype == np.int64
    # a non-contiguous view (a window of a longer array) reads the same
    found, first = _first_true(np.eye(12, dtype=bool)[:, 2:10])
    assert found.tolist() == [False, False] + [True] * 8 + [False, False]
    assert first.tolist()[2:10] == list(range(8))


@pytest.mark.parametrize(("asked", "cap"), [(1, 16), (16, 16), (17, 32), (1024, 1024), (1025, 2048)])
def test_the_capacity_is_the_power_of_two_at_or_above_the_request_and_at_least_16(asked: int, cap: int) -> None:
    table = U64Table(asked)
    assert table.cap == cap
    # WINDOW − 1 padding slots after the last one: a probe range starting there stays inside the arrays
    assert table.keys.shape == table.ents.shape == (cap + WINDOW - 1,)
    assert table.keys.dtype == np.uint64 and table.ents.dtype == np.int32
    assert (table.ents == EMPTY).all()
    assert table.live == table.used == 0 and table.overflow == {}
    assert table.nbytes() == (cap + WINDOW - 1) * (8 + 4)


def test_the_default_capacity_is_1024() -> None:
    assert U64Table().cap == 1024


def test_a_key_lands_on_its_fibonacci_home_slot() -> None:
    table = U64Table(1024)
    keys = [key_at_home(s, 10, salt=7) for s in (0, 1, 511, 1000, 1023)]
    table.insert_new(u64(keys), i64([10, 11, 12, 13, 14]))
    e, slots = lookup(table, keys)
    assert e == [10, 11, 12, 13, 14]
    assert slots == [0, 1, 511, 1000, 1023]
    assert table.keys[slots].tolist() == keys and table.live == table.used == 5
    # the same keys in a table of 2048 slots: one more bit of key·GOLD picks the home
    big = U64Table(2048)
    big.insert_new(u64(keys), i64([10, 11, 12, 13, 14]))
    assert lookup(big, keys)[1] == [(k * GOLD % (1 << 64)) >> 53 for k in keys]


def test_absent_keys_give_minus_one_for_entry_and_slot() -> None:
    table = U64Table(16)
    assert lookup(table, [5, 6]) == ([-1, -1], [-1, -1])
    a, b = key_at_home(3, 4), key_at_home(3, 4, salt=1)
    table.insert_new(u64([a]), i64([0]))  # entry id 0 is an entry like any other
    assert lookup(table, [a, b, 5]) == ([0, -1, -1], [3, -1, -1])


def test_colliding_keys_fill_the_window_in_order_then_overflow() -> None:
    table = U64Table(1024)  # far from the load limit: 10 keys sharing a home stay in this table
    keys = [key_at_home(5, 10, salt=s) for s in range(WINDOW + 2)]
    # one batch: among keys racing for a slot the lowest index wins and the others retry the next free slot
    table.insert_new(u64(keys[:WINDOW]), i64(list(range(100, 100 + WINDOW))))
    e, slots = lookup(table, keys[:WINDOW])
    assert e == list(range(100, 100 + WINDOW))
    assert slots == list(range(5, 5 + WINDOW))
    # the window (home and the 7 slots after it) is full: the next keys go to the overflow dict
    table.insert_new(u64(keys[WINDOW:]), i64([200, 0]))
    assert table.overflow == {keys[WINDOW]: 200, keys[WINDOW + 1]: 0}
    assert table.live == WINDOW + 2 and table.used == WINDOW
    assert lookup(table, keys[WINDOW:]) == ([200, 0], [OVERFLOW, OVERFLOW])
    absent = key_at_home(5, 10, salt=99)
    assert lookup(table, [absent, *keys]) == ([-1, *range(100, 108), 200, 0], [-1, *range(5, 13), OVERFLOW, OVERFLOW])
    keys_out, ents_out = table.live_items()
    assert sorted(zip(keys_out.tolist(), ents_out.tolist(), strict=True)) == sorted(
        zip(keys, [*range(100, 108), 200, 0], strict=True)
    )
    assert ents_out.dtype == np.int64 and keys_out.dtype == np.uint64
    # deleting an overflow key pops it from the dict; a key in the window becomes a tombstone
    table.delete(i64([OVERFLOW, 5]), u64([keys[WINDOW], keys[0]]))
    assert table.overflow == {keys[WINDOW + 1]: 0}
    assert table.ents[5] == TOMB and table.live == WINDOW
    assert lookup(table, [keys[WINDOW], keys[0], keys[WINDOW + 1], keys[1]]) == (
        [-1, -1, 0, 101],
        [-1, -1, OVERFLOW, 6],
    )


def test_an_overflow_key_is_found_only_when_its_window_is_full() -> None:
    """A key absent from a window with an EMPTY slot cannot be in the overflow dict; with a full window it is
    looked up there: an overflow key stays found while its window's keys come and go."""
    table = U64Table(1024)
    keys = [key_at_home(2, 10, salt=s) for s in range(WINDOW + 1)]
    table.insert_new(u64(keys), i64(list(range(1, WINDOW + 2))))
    assert lookup(table, [keys[-1]]) == ([WINDOW + 1], [OVERFLOW])
    table.delete(i64([2 + 3]), u64([keys[3]]))  # a tombstone in the window: still no EMPTY slot
    assert lookup(table, [keys[-1], keys[3]]) == ([WINDOW + 1, -1], [OVERFLOW, -1])


def test_a_window_at_the_last_slot_runs_into_the_padding_not_around() -> None:
    table = U64Table(16)
    keys = [key_at_home(15, 4, salt=s) for s in range(WINDOW)]
    table.insert_new(u64(keys), i64(list(range(1, WINDOW + 1))))
    e, slots = lookup(table, keys)
    assert e == list(range(1, WINDOW + 1))
    assert slots == list(range(15, 15 + WINDOW))  # slots 16..22 are the padding
    assert (table.ents[:15] == EMPTY).all()
    keys_out, ents_out = table.live_items()
    assert sorted(ents_out.tolist()) == list(range(1, WINDOW + 1))
    assert sorted(keys_out.tolist()) == sorted(keys)


def test_a_tombstone_is_reused_without_raising_the_load() -> None:
    table = U64Table(16)
    a, b, c = (key_at_home(9, 4, salt=s) for s in range(3))
    table.insert_new(u64([a, b]), i64([1, 2]))
    _, slots = lookup(table, [a])
    table.delete(i64(slots), u64([a]))
    assert table.live == 1 and table.used == 2  # the tombstone still counts toward the load
    assert lookup(table, [a, b]) == ([-1, 2], [-1, 10])  # b is found past the tombstone
    table.insert_new(u64([c]), i64([3]))  # absent, so it may take the tombstone at its home
    assert lookup(table, [c, b]) == ([3, 2], [9, 10])
    assert table.live == 2 and table.used == 2


def test_the_load_limit_rebuilds_only_past_half_full() -> None:
    assert MAX_LOAD == 0.5
    table = U64Table(16)
    keys = [key_at_home(s, 4, salt=s) for s in range(9)]
    table.insert_new(u64(keys[:8]), i64(list(range(8))))  # 8 used of 16: at the limit, not past it
    assert table.cap == 16 and table.used == table.live == 8
    table.insert_new(u64(keys[8:]), i64([8]))  # 9 > 8: rebuilt, grown while live > cap / 4: 9 keys → 64 slots
    assert table.cap == 64 and table.live == table.used == 9
    assert lookup(table, keys)[0] == list(range(9))


def test_a_rebuild_keeps_the_size_when_live_keys_fit_a_quarter_and_drops_tombstones() -> None:
    table = U64Table(16)
    keys = [key_at_home(s, 4, salt=s) for s in range(9)]
    table.insert_new(u64(keys[:8]), i64(list(range(8))))
    _, slots = table.lookup(u64(keys[:5]))
    table.delete(slots, u64(keys[:5]))
    assert table.live == 3 and table.used == 8
    table.insert_new(u64(keys[8:]), i64([8]))  # 8 + 1 past the limit: rebuilt for 4 live keys = 16 / 4
    assert table.cap == 16
    assert table.live == table.used == 4
    assert (table.ents[: table.cap + WINDOW - 1] == TOMB).sum() == 0
    assert lookup(table, keys)[0] == [-1] * 5 + [5, 6, 7, 8]


def test_a_rebuild_grows_by_doubling_until_the_live_keys_fit_a_quarter() -> None:
    table = U64Table(16)
    keys = [key_at_home(s % 16, 4, salt=s) for s in range(17)]
    table.insert_new(u64(keys), i64(list(range(17))))  # 17 > 64 / 4: 128 slots, not 256
    assert table.cap == 128
    assert lookup(table, keys)[0] == list(range(17))
    table = U64Table(16)
    table.insert_new(u64(keys[:16]), i64(list(range(16))))  # 16 = 64 / 4: 64 slots
    assert table.cap == 64


def test_compaction_only_when_tombstones_dominate() -> None:
    """`maybe_compact` rebuilds when used > 0.9 · MAX_LOAD · cap (7.2 of 16 slots) and live < used // 2."""
    keys = [key_at_home(s, 4, salt=s) for s in range(8)]

    def table_after_deleting(inserted: int, deleted: int) -> U64Table:
        table = U64Table(16)
        table.insert_new(u64(keys[:inserted]), i64(list(range(inserted))))
        _, slots = table.lookup(u64(keys[:deleted]))
        table.delete(slots, u64(keys[:deleted]))
        return table

    compacted = table_after_deleting(8, 5)  # used 8 > 7.2, live 3 < 4
    assert compacted.maybe_compact() is True
    assert compacted.used == compacted.live == 3 and compacted.cap == 16
    assert lookup(compacted, keys)[0] == [-1] * 5 + [5, 6, 7]
    assert compacted.maybe_compact() is False  # nothing left to compact
    kept = table_after_deleting(8, 4)  # live 4 = used // 2: not fewer
    assert kept.maybe_compact() is False and kept.used == 8
    light = table_after_deleting(7, 7)  # used 7 <= 7.2
    assert light.maybe_compact() is False and light.used == 7


def test_a_table_at_a_higher_load_limit_keeps_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past half full (the limit raised, as the overloaded property test does) windows fill and keys overflow;
    every key stays found with its own entry, through deletes and reinserts."""
    monkeypatch.setattr(_table, "MAX_LOAD", 0.97)
    rng = np.random.default_rng(5)
    keys = rng.integers(0, 2**64 - 1, size=15, dtype=np.uint64)
    table = U64Table(16)
    table.insert_new(keys, np.arange(15, dtype=np.int64))
    assert table.cap == 16 and table.live == 15
    assert lookup(table, keys.tolist())[0] == list(range(15))
    _, slots = table.lookup(keys[::2])
    table.delete(slots, keys[::2])
    assert table.live == 7
    got = lookup(table, keys.tolist())[0]
    assert got == [-1 if i % 2 == 0 else i for i in range(15)]
    table.insert_new(keys[::2], np.arange(100, 108, dtype=np.int64))
    assert lookup(table, keys.tolist())[0] == [100 + i // 2 if i % 2 == 0 else i for i in range(15)]


def test_entry_id_zero_is_found_past_its_home_slot() -> None:
    """Any id >= 0 is an entry (only EMPTY and TOMB are negative): 0 is found where a collision put it."""
    table = U64Table(16)
    first, second = key_at_home(6, 4), key_at_home(6, 4, salt=1)
    table.insert_new(u64([first, second]), i64([5, 0]))
    assert lookup(table, [second, first]) == ([0, 5], [7, 6])
    keys_out, ents_out = table.live_items()
    assert sorted(zip(keys_out.tolist(), ents_out.tolist(), strict=True)) == sorted([(first, 5), (second, 0)])
