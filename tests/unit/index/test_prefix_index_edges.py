"""The numpy prefix index (`kvmesh.index.prefix_index`, the fallback when the C core is not built) at the edges of
its contract: a match ending on each side of the query chunks (64, then 512, 4096, ... blocks), workers in the
second mask word, every input type, duplicates in one call, a worker that stores nothing, clear and removal,
slot reuse, the exact byte count and the stats, and snapshots restored and used again. Small and deterministic:
the benchmark's mutation run goes through these for every mutant of the index."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.index import NATIVE, NativePrefixIndex, NumpyPrefixIndex, _snapshot

pytestmark = pytest.mark.unit

# chunk ends of `find_matches`: 64, 64 + 512, 64 + 512 + 4096
FIRST, SECOND = 64, 64 + 512
CHAIN = [(i * 0x9E3779B97F4A7C15 + 12345) % (1 << 64) for i in range(SECOND + 130)]
TABLE_SLOT_BYTES = 8 + 4  # a uint64 key and an int32 entry id per table slot
WINDOW_PADDING = 7  # slots after the last one, so a probe range never wraps around


def reference(held: dict[str, set[int]], query: list[int]) -> dict[str, int]:
    """The radix-tree rule: a worker matches the blocks it holds up to its first missing one."""
    out = {}
    for worker, blocks in held.items():
        m = 0
        while m < len(query) and query[m] in blocks:
            m += 1
        if m:
            out[worker] = m
    return out


def fill(idx: NumpyPrefixIndex, n: int, prefix: str = "f") -> list[str]:
    """`n` workers that hold nothing the tests query (they take the low slots)."""
    names = [f"{prefix}{i}" for i in range(n)]
    for i, name in enumerate(names):
        idx.store(name, None, [(1 << 60) + i])
    return names


def test_nothing_matches_an_empty_query_or_an_empty_index() -> None:
    idx = NumpyPrefixIndex()
    assert idx.find_matches([1, 2]) == {}
    idx.store("a", None, [1, 2])
    assert idx.find_matches([]) == {}
    assert idx.find_matches(np.empty(0, dtype=np.uint64)) == {}
    assert idx.find_matches([3, 1, 2]) == {}  # a worker missing block 0 matches nothing
    assert idx.find_matches([1, 2]) == {"a": 2}


@pytest.mark.parametrize("low_slots", [0, 64])
def test_matches_ending_either_side_of_each_chunk_boundary(low_slots: int) -> None:
    """Workers whose match ends on every position around the chunk ends (63, 64, 65; 575, 576, 577), at 1 and 2,
    several on the same block, one that holds the whole query; with `low_slots` = 64 they all sit in the second
    mask word."""
    idx = NumpyPrefixIndex()
    held: dict[str, set[int]] = {name: set() for name in fill(idx, low_slots)}
    ends = [1, 2, FIRST - 1, FIRST, FIRST + 1, SECOND - 1, SECOND, SECOND + 1, 100, 100, 100, 300, 301]
    for k, end in enumerate(ends):
        name = f"m{k}"
        blocks = CHAIN[:end] + CHAIN[end + 1 :][:40]  # blocks past the first missing one do not count
        idx.store(name, None, blocks)
        held[name] = set(blocks)
    idx.store("whole", None, CHAIN)
    held["whole"] = set(CHAIN)
    idx.store("late", None, CHAIN[1:])  # everything but block 0
    held["late"] = set(CHAIN[1:])
    for n in (1, 2, FIRST, FIRST + 1, SECOND, SECOND + 1, len(CHAIN)):
        query = CHAIN[:n]
        want = reference(held, query)
        assert idx.find_matches(query) == want
        assert idx.find_matches(np.array(query, dtype=np.uint64)) == want
    assert idx.find_matches(CHAIN)["whole"] == len(CHAIN)
    assert idx.find_matches(CHAIN)["m5"] == SECOND - 1
    assert "late" not in idx.find_matches(CHAIN)


def test_a_match_ends_at_the_first_missing_block_within_one_chunk() -> None:
    idx = NumpyPrefixIndex()
    idx.store("a", None, [1, 2, 3, 4, 5, 6])
    idx.store("b", None, [1, 2, 3])
    idx.store("c", None, [1, 2, 3, 4, 5])
    idx.store("d", None, [1])
    assert idx.find_matches([1, 2, 3, 4, 5, 6, 7]) == {"a": 6, "b": 3, "c": 5, "d": 1}
    idx.remove("a", [4])
    assert idx.find_matches([1, 2, 3, 4, 5, 6, 7]) == {"a": 3, "b": 3, "c": 5, "d": 1}


def test_workers_past_the_first_mask_word_are_named_right() -> None:
    idx = NumpyPrefixIndex()
    names = [f"w{i}" for i in range(130)]
    for i, name in enumerate(names):
        idx.store(name, None, [7, 100 + i])
    assert idx.stats()["mask_words"] == 3.0
    assert idx.find_matches([7]) == dict.fromkeys(names, 1)
    for i in (0, 63, 64, 65, 127, 128, 129):
        assert idx.find_matches([7, 100 + i]) == {**dict.fromkeys(names, 1), names[i]: 2}
        assert idx.num_blocks(names[i]) == 2
        assert sorted(idx.blocks_of(names[i]).tolist()) == [7, 100 + i]
    idx.clear("w64")
    assert idx.num_blocks("w64") == 0 and idx.num_blocks("w0") == 2 and idx.num_blocks("w128") == 2
    assert "w64" not in idx.find_matches([7]) and "w64" in idx.workers()
    idx.remove("w65", [7])
    assert idx.find_matches([7, 165]) == {n: 1 for n in names if n not in ("w64", "w65")}
    assert idx.num_pairs() == 2 * 130 - 3


@pytest.mark.parametrize(
    "as_input",
    [
        list,
        tuple,
        lambda xs: np.array(xs, dtype=np.uint64),
        lambda xs: np.array(xs, dtype=np.uint64).astype(np.int64),  # the same 64 bits read as signed
    ],
    ids=["list", "tuple", "uint64", "int64"],
)
def test_every_input_type_names_the_same_blocks(as_input: object) -> None:
    hashes = [0, 1, 2**53 + 1, 2**63, 2**64 - 1]  # exact past float precision and past int64
    convert = as_input  # type: ignore[assignment]
    idx = NumpyPrefixIndex()
    idx.store("a", None, convert(hashes))  # type: ignore[operator]
    assert sorted(idx.blocks_of("a").tolist()) == sorted(hashes)
    assert idx.blocks_of("a").dtype == np.uint64
    assert idx.find_matches(convert(hashes)) == {"a": 5}  # type: ignore[operator]
    assert idx.find_matches(hashes) == {"a": 5}
    idx.remove("a", convert(hashes[3:]))  # type: ignore[operator]
    assert sorted(idx.blocks_of("a").tolist()) == hashes[:3]


def test_small_int_lists_are_64_bit_hashes() -> None:
    idx = NumpyPrefixIndex()
    idx.store("a", None, [3, 4])
    idx.store("b", None, [2**64 - 1])
    assert idx.find_matches(np.array([3, 4], dtype=np.uint64)) == {"a": 2}
    assert idx.find_matches([2**64 - 1, 3]) == {"b": 1}
    assert idx.find_matches(np.array([-1], dtype=np.int64)) == {"b": 1}


def test_storing_duplicates_and_known_blocks_counts_each_block_once() -> None:
    idx = NumpyPrefixIndex()
    idx.store("a", None, [5, 5, 5])
    assert idx.num_entries() == 1 and idx.num_pairs() == 1 and idx.blocks_of("a").tolist() == [5]
    idx.store("a", 5, [5, 6, 6, 7])  # the parent is not needed: hashes are chained
    assert idx.num_entries() == 3 and idx.num_pairs() == 3
    idx.store("b", None, [7, 6, 8, 8])
    assert idx.num_entries() == 4 and idx.num_pairs() == 6
    assert idx.find_matches([5, 6, 7, 8]) == {"a": 3}
    assert idx.find_matches([7, 6, 8]) == {"a": 2, "b": 3}
    idx.store("c", None, [9])  # one new block alone
    assert idx.find_matches([9, 5]) == {"c": 1} and idx.num_entries() == 5


def test_a_worker_that_stores_nothing_is_known_and_holds_nothing() -> None:
    idx = NumpyPrefixIndex()
    idx.store("a", None, [])
    idx.store("b", None, np.empty(0, dtype=np.uint64))
    assert idx.workers() == ["a", "b"]
    assert idx.num_blocks("a") == 0 and idx.num_pairs() == 0 and idx.num_entries() == 0
    assert idx.stats()["workers"] == 2.0


def test_remove_drops_only_the_workers_own_blocks_and_frees_unheld_entries() -> None:
    idx = NumpyPrefixIndex()
    idx.store("a", None, [1, 2, 3, 4])
    idx.store("b", None, [1, 2])
    idx.remove("zz", [1, 2])  # an unknown worker: nothing
    idx.remove("a", [])
    idx.remove("a", [99, 98])  # blocks nobody holds
    assert idx.num_pairs() == 6 and idx.num_entries() == 4
    idx.remove("a", [2, 3, 3, 2])  # duplicates in one call: each block once
    assert idx.num_entries() == 3 and idx.num_pairs() == 4
    assert idx.find_matches([1, 2, 3, 4]) == {"a": 1, "b": 2}
    idx.remove("b", [2])
    assert idx.num_entries() == 2
    assert idx.find_matches([1, 2]) == {"a": 1, "b": 1}
    idx.remove("b", [1, 1])
    assert idx.find_matches([1]) == {"a": 1} and idx.num_entries() == 2  # a still holds 1
    idx.remove("a", np.array([1, 4], dtype=np.uint64))
    assert idx.num_entries() == 0 and idx.num_pairs() == 0 and idx.find_matches([1]) == {}
    # freed entries are reused: the index stores them again without growing
    size = idx.nbytes()
    idx.store("c", None, [2, 3, 4])
    assert idx.find_matches([2, 3, 4]) == {"c": 3} and idx.num_entries() == 3
    assert idx.nbytes() == size - 3 * 8  # three of the four free entry ids taken back
    idx.remove("b", [2])  # b no longer holds 2: c's block stays
    assert idx.find_matches([2]) == {"c": 1}


def test_remove_of_one_block_leaves_the_rest_of_the_chain() -> None:
    idx = NumpyPrefixIndex()
    idx.store("a", None, [1, 2, 3])
    idx.remove("a", [3])
    assert idx.find_matches([1, 2, 3]) == {"a": 2} and idx.num_entries() == 2
    idx.remove("a", [1])
    assert idx.find_matches([1, 2, 3]) == {} and idx.find_matches([2]) == {"a": 1}
    assert idx.blocks_of("a").tolist() == [2]


def test_clear_forgets_the_blocks_and_keeps_the_worker() -> None:
    idx = NumpyPrefixIndex()
    idx.clear("nobody")
    idx.store("a", None, [1, 2, 3])
    idx.store("b", None, [1, 2])
    idx.store("idle", None, [])
    idx.clear("idle")  # a known worker with no blocks
    idx.clear("a")
    assert idx.workers() == ["a", "b", "idle"]
    assert idx.num_blocks("a") == 0 and idx.blocks_of("a").tolist() == []
    assert idx.find_matches([1, 2, 3]) == {"b": 2}
    assert idx.num_entries() == 2 and idx.num_pairs() == 2  # block 3 had no other holder
    idx.clear("b")
    assert idx.num_entries() == 0 and idx.num_pairs() == 0
    idx.store("a", None, [3, 4])
    assert idx.find_matches([3, 4]) == {"a": 2} and idx.num_entries() == 2


def test_remove_worker_frees_its_slot_for_the_next_new_worker() -> None:
    idx = NumpyPrefixIndex()
    names = fill(idx, 64)
    idx.store("f3", None, [1, 2])
    idx.remove_worker("nobody")
    idx.remove_worker("f3")
    assert "f3" not in idx.workers() and len(idx.workers()) == 63
    assert idx.find_matches([1, 2]) == {} and idx.num_blocks("f3") == 0
    assert idx.num_entries() == 63
    idx.store("new", None, [1])  # takes f3's slot: still one mask word
    assert idx.stats()["mask_words"] == 1.0
    assert idx.find_matches([1, 2]) == {"new": 1}
    idx.store("another", None, [1])  # no free slot left: a second word
    assert idx.stats()["mask_words"] == 2.0
    assert idx.find_matches([1]) == {"new": 1, "another": 1}
    assert sorted(idx.workers()) == sorted([*(n for n in names if n != "f3"), "new", "another"])


def test_num_blocks_and_blocks_of_an_unknown_worker() -> None:
    idx = NumpyPrefixIndex()
    idx.store("a", None, [1])
    assert idx.num_blocks("b") == 0
    empty = idx.blocks_of("b")
    assert empty.shape == (0,) and empty.dtype == np.uint64


def test_iter_pairs_lists_each_worker_and_block() -> None:
    idx = NumpyPrefixIndex()
    idx.store("a", None, [1, 2])
    idx.store("b", None, [2])
    assert sorted(idx.iter_pairs()) == [("a", 1), ("a", 2), ("b", 2)]
    assert list(NumpyPrefixIndex().iter_pairs()) == []


def test_nbytes_is_the_size_of_the_buffers() -> None:
    """Table slots (12 B each, the power of two at or above twice the capacity, plus the probe padding), then a
    key (8 B) and one mask word (8 B) per entry row, plus 8 B per freed entry id."""
    idx = NumpyPrefixIndex(capacity=1024)
    table = 12 * (2048 + WINDOW_PADDING)
    assert idx.nbytes() == table + 1024 * 8 + 1024 * 8
    fill(idx, 65)  # a second mask word on every row
    assert idx.nbytes() == table + 1024 * 8 + 1024 * 16
    idx.remove("f0", [1 << 60])  # one freed entry id
    assert idx.nbytes() == table + 1024 * 8 + 1024 * 16 + 8
    small = NumpyPrefixIndex(capacity=1)  # at least 16 rows and 16 table slots
    assert small.nbytes() == 12 * (16 + WINDOW_PADDING) + 16 * 8 + 16 * 8


def test_entry_rows_grow_and_keep_what_they_held() -> None:
    """Past its capacity the index grows its entry rows, one entry past them and many at once, and every block
    stays where it was (row 0 is the empty row that misses read)."""
    idx = NumpyPrefixIndex(capacity=16)
    idx.store("a", None, CHAIN[:15])  # 15 entries and the empty row fill 16 rows
    idx.store("b", None, CHAIN[:16])  # one more
    assert idx.find_matches(CHAIN[:20]) == {"a": 15, "b": 16}
    idx.store("c", None, CHAIN[16:100])  # 84 more at once
    idx.store("d", None, CHAIN[:2])
    assert idx.find_matches(CHAIN[:101]) == {"a": 15, "b": 16, "d": 2}
    assert idx.find_matches(CHAIN[16:101]) == {"c": 84}
    assert idx.num_entries() == 100 and idx.num_pairs() == 15 + 16 + 84 + 2
    assert sorted(idx.blocks_of("a").tolist()) == sorted(CHAIN[:15])
    assert sorted(idx.blocks_of("c").tolist()) == sorted(CHAIN[16:100])


def test_stats_report_the_documented_figures() -> None:
    idx = NumpyPrefixIndex()
    empty = idx.stats()
    assert empty == {
        "workers": 0.0,
        "blocks": 0.0,
        "pairs": 0.0,
        "bytes": float(idx.nbytes()),
        "bytes_per_pair": 0.0,
        "table_capacity": 2048.0,
        "table_load": 0.0,
        "mask_words": 1.0,
    }
    idx.store("a", None, [1, 2, 3])
    idx.store("b", None, [1])
    stats = idx.stats()
    assert stats == {
        "workers": 2.0,
        "blocks": 3.0,
        "pairs": 4.0,
        "bytes": float(idx.nbytes()),
        "bytes_per_pair": idx.nbytes() / 4,
        "table_capacity": 2048.0,
        "table_load": 3 / 2048,
        "mask_words": 1.0,
    }
    assert all(type(v) is float for v in stats.values())


def test_a_snapshot_restores_the_same_index_which_keeps_working() -> None:
    idx = NumpyPrefixIndex(capacity=16)
    fill(idx, 66)  # two mask words
    for i in range(0, 66, 3):
        idx.remove_worker(f"f{i}")  # free slots, the highest last
    idx.store("a", None, CHAIN[:40])
    idx.store("b", None, CHAIN[:10])
    restored = NumpyPrefixIndex.restore(idx.snapshot())
    assert sorted(restored.workers()) == sorted(idx.workers())
    assert restored.find_matches(CHAIN[:50]) == {"a": 40, "b": 10}
    assert restored.num_pairs() == idx.num_pairs() and restored.num_entries() == idx.num_entries()
    assert sorted(restored.iter_pairs()) == sorted(idx.iter_pairs())
    assert restored.stats()["mask_words"] == 2.0
    # new entries go after the restored ones, and the table finds both
    restored.store("c", None, [*CHAIN[40:45], 2**64 - 1])
    restored.store("a", None, CHAIN[40:42])
    assert restored.find_matches(CHAIN[:50]) == {"a": 42, "b": 10}
    assert restored.find_matches(CHAIN[40:45]) == {"a": 2, "c": 5}
    assert sorted(restored.blocks_of("b").tolist()) == sorted(CHAIN[:10])
    restored.remove("a", CHAIN[:5])
    assert restored.find_matches(CHAIN[:50]) == {"b": 10}


def test_a_restored_index_reuses_the_free_slots_lowest_first_as_the_c_core_does() -> None:
    idx = NumpyPrefixIndex()
    fill(idx, 66)
    for i in (0, 3, 65, 9):
        idx.remove_worker(f"f{i}")
    snapshot = idx.snapshot()
    restored = NumpyPrefixIndex.restore(snapshot)
    for i in range(5):
        restored.store(f"n{i}", None, [i])
    names = _snapshot.decode(restored.snapshot())[0]
    assert [names[s] for s in (0, 3, 9, 65, 66)] == ["n0", "n1", "n2", "n3", "n4"]
    assert restored.stats()["mask_words"] == 2.0
    assert restored.find_matches([4]) == {"n4": 1} and restored.find_matches([1 << 60]) == {}
    if NATIVE:
        native = NativePrefixIndex.restore(snapshot)
        for i in range(5):
            native.store(f"n{i}", None, [i])
        assert _snapshot.decode(native.snapshot())[0] == names


def test_a_snapshot_of_an_empty_index_and_of_one_bigger_than_its_capacity() -> None:
    empty = NumpyPrefixIndex.restore(NumpyPrefixIndex().snapshot())
    assert empty.workers() == [] and empty.num_entries() == 0 and empty.find_matches([1]) == {}
    empty.store("a", None, [1])
    assert empty.find_matches([1]) == {"a": 1}
    idx = NumpyPrefixIndex(capacity=4)
    idx.store("a", None, CHAIN[:300])
    idx.store("b", None, CHAIN[:3])
    copy = NumpyPrefixIndex.restore(idx.snapshot())
    assert copy.find_matches(CHAIN[:301]) == {"a": 300, "b": 3}
    copy.store("b", None, CHAIN[3:400])
    assert copy.find_matches(CHAIN[:401]) == {"a": 300, "b": 400}
    assert copy.num_entries() == 400


def test_snapshots_read_the_same_in_the_c_core() -> None:
    if NativePrefixIndex is None:
        pytest.skip("kvmesh.index._native is not built (pip install -e . compiles it)")
    idx = NumpyPrefixIndex()
    fill(idx, 70)
    idx.store("a", None, CHAIN[:20])
    idx.store("f68", None, CHAIN[:5])
    native = NativePrefixIndex.restore(idx.snapshot())
    assert native.find_matches(CHAIN[:30]) == {"a": 20, "f68": 5}
    back = NumpyPrefixIndex.restore(native.snapshot())
    assert back.find_matches(CHAIN[:30]) == {"a": 20, "f68": 5}
    assert back.num_pairs() == idx.num_pairs()
