"""Both PrefixIndex implementations (numpy reference, C core) vs a naive reference (worker -> set of hashes with
the prefix rule), under random op sequences; snapshots are interchangeable between them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvmesh.index._table as table_mod
from kvmesh.index import NATIVE, NativePrefixIndex, NumpyPrefixIndex, PrefixIndex

pytestmark = pytest.mark.unit

WORKERS = [f"w{i}" for i in range(70)]  # > 64: worker masks span two words
# small alphabet so ops collide; a few huge values to exercise the full uint64 range (0 included)
HASH = st.one_of(st.integers(0, 60), st.sampled_from([0, 2**63, 2**64 - 1, 2**64 - 2]))
HASHES = st.lists(HASH, max_size=24)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.sampled_from(WORKERS[:6] + WORKERS[64:]), HASHES),
        st.tuples(st.just("remove"), st.sampled_from(WORKERS[:6] + WORKERS[64:]), HASHES),
        st.tuples(st.just("clear"), st.sampled_from(WORKERS[:6] + WORKERS[64:]), st.just([])),
        st.tuples(st.just("remove_worker"), st.sampled_from(WORKERS[:6] + WORKERS[64:]), st.just([])),
    ),
    max_size=40,
)
QUERIES = st.lists(st.lists(HASH, max_size=30), min_size=1, max_size=4)


def reference_matches(ref: dict[str, set[int]], query: list[int]) -> dict[str, int]:
    out = {}
    for worker, held in ref.items():
        m = 0
        for h in query:
            if h not in held:
                break
            m += 1
        if m:
            out[worker] = m
    return out


Index = Any  # either implementation


def apply(idx: Index, ref: dict[str, set[int]], op: tuple[str, str, list[int]]) -> None:
    kind, worker, hashes = op
    if kind == "store":
        idx.store(worker, None, hashes)
        ref.setdefault(worker, set()).update(hashes)
    elif kind == "remove":
        idx.remove(worker, hashes)
        ref.get(worker, set()).difference_update(hashes)
    elif kind == "clear":
        idx.clear(worker)
        if worker in ref:
            ref[worker] = set()
    else:
        idx.remove_worker(worker)
        ref.pop(worker, None)


def check(idx: Index, ref: dict[str, set[int]], queries: list[list[int]]) -> None:
    for q in queries:
        assert idx.find_matches(q) == reference_matches(ref, q)
        assert idx.find_matches(np.array(q, dtype=np.uint64)) == reference_matches(ref, q)
    for worker in WORKERS[:6] + WORKERS[64:]:
        assert idx.num_blocks(worker) == len(ref.get(worker, ()))
        assert sorted(idx.blocks_of(worker).tolist()) == sorted(ref.get(worker, ()))
    assert sorted(idx.iter_pairs()) == sorted((w, h) for w, s in ref.items() for h in s)
    assert idx.num_pairs() == sum(len(held) for held in ref.values())
    assert set(idx.workers()) == set(ref)


@pytest.fixture(params=["numpy", "numpy-overloaded", "native"])
def impl(request: pytest.FixtureRequest) -> Iterator[Callable[..., Index]]:
    """The implementation under test. numpy-overloaded (MAX_LOAD 0.97) forces full probe windows: overflow-dict
    inserts, lookups and deletes get exercised. native: the C core, started at its smallest table (16 slots) so
    growth and backward-shift deletion in long probe runs happen constantly."""
    if request.param == "native":
        if NativePrefixIndex is None:
            pytest.skip("kvmesh.index._native is not built (pip install -e . compiles it)")
        yield NativePrefixIndex
        return
    old = table_mod.MAX_LOAD
    table_mod.MAX_LOAD = 0.97 if request.param == "numpy-overloaded" else 0.5
    yield NumpyPrefixIndex
    table_mod.MAX_LOAD = old


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, queries=QUERIES)
def test_matches_reference_under_random_interleavings(
    impl: Callable[..., Index], ops: list[tuple[str, str, list[int]]], queries: list[list[int]]
) -> None:
    idx, ref = impl(capacity=8), dict[str, set[int]]()
    for op in ops:
        apply(idx, ref, op)
        check(idx, ref, queries)
    restored = type(idx).restore(idx.snapshot())
    check(restored, ref, queries)
    # the restored index keeps working
    apply(restored, ref, ("store", "w0", queries[0]))
    check(restored, ref, queries)
    # snapshots are interchangeable between the implementations
    for other in (NumpyPrefixIndex, NativePrefixIndex):
        if other is not None:
            check(other.restore(restored.snapshot()), ref, queries)


def test_default_is_the_native_core_when_built() -> None:
    assert PrefixIndex is (NativePrefixIndex if NATIVE else NumpyPrefixIndex)


def test_match_stops_at_first_missing_block_even_if_later_present(impl: Callable[..., Index]) -> None:
    idx = impl()
    idx.store("a", None, [1, 2, 3, 4, 5])
    idx.store("b", None, [1, 2])
    idx.remove("a", [3])  # out of order: a middle block goes first
    assert idx.find_matches([1, 2, 3, 4, 5]) == {"a": 2, "b": 2}
    assert idx.find_matches([9, 1, 2]) == {}
    idx.store("a", 2, [3])
    assert idx.find_matches([1, 2, 3, 4, 5, 6]) == {"a": 5, "b": 2}


def test_worker_slots_are_reused_after_remove_worker(impl: Callable[..., Index]) -> None:
    idx = impl()
    for i in range(130):
        idx.store(f"w{i}", None, [10_000 + i, 20_000 + i])
    for i in range(0, 130, 2):
        idx.remove_worker(f"w{i}")
    for i in range(65):
        idx.store(f"n{i}", None, [7, 8])
    assert idx.find_matches([7, 8]) == {f"n{i}": 2 for i in range(65)}
    assert idx.find_matches([10_001, 20_001]) == {"w1": 2}
    assert len(idx.workers()) == 130
    assert idx.stats()["mask_words"] == 3.0


def test_large_random_against_reference(impl: Callable[..., Index]) -> None:
    """Bulk check at a size where the table grows, rebuilds and compacts many times."""
    rng = np.random.default_rng(0)
    idx, ref = impl(), dict[str, set[int]]()
    pool = rng.integers(0, 2**64 - 1, size=20_000, dtype=np.uint64)
    for step in range(400):
        worker = f"w{int(rng.integers(80))}"
        hs = pool[rng.integers(0, pool.shape[0], size=int(rng.integers(1, 200)))]
        op = "remove" if step % 3 == 2 else "store"
        apply(idx, ref, (op, worker, hs.tolist()))
    chains = [pool[i : i + 300] for i in range(0, 20_000, 997)]
    for q in chains:
        assert idx.find_matches(q) == reference_matches(ref, q.tolist())
    assert idx.num_pairs() == sum(len(held) for held in ref.values())


def test_shared_chains_many_workers_against_reference(impl: Callable[..., Index]) -> None:
    """300 workers (5 mask words) storing prefixes of 40 shared chains: blocks held by 1 to ~30 workers move
    between inline and spilled holder sets; removals out of order, clears and worker removals interleaved."""
    rng = np.random.default_rng(1)
    chains = rng.integers(0, 2**64 - 1, size=(40, 200), dtype=np.uint64)
    idx, ref = impl(), dict[str, set[int]]()
    workers = [f"w{i}" for i in range(300)]
    for step in range(3000):
        worker = workers[int(rng.integers(len(workers)))]
        chain = chains[int(rng.integers(chains.shape[0]))]
        r = int(rng.integers(100))
        if r < 70:
            apply(idx, ref, ("store", worker, chain[: int(rng.integers(1, 200))]))
        elif r < 95:
            a = int(rng.integers(200))
            apply(idx, ref, ("remove", worker, chain[a : a + int(rng.integers(1, 40))]))
        elif r < 98:
            apply(idx, ref, ("clear", worker, []))
        else:
            apply(idx, ref, ("remove_worker", worker, []))
        if step % 500 == 499:
            for q in chains[:10]:
                assert idx.find_matches(q) == reference_matches(ref, q.tolist())
    for q in chains:
        want = reference_matches(ref, q.tolist())
        assert idx.find_matches(q) == want
        assert idx.find_matches(q.tolist()) == want
        assert idx.find_matches(q.astype(np.int64)) == want
    assert idx.num_pairs() == sum(len(held) for held in ref.values())
    for other in (NumpyPrefixIndex, NativePrefixIndex):
        if other is not None:
            copy = other.restore(idx.snapshot())
            for q in chains:
                assert copy.find_matches(q) == reference_matches(ref, q.tolist())
            assert copy.num_pairs() == idx.num_pairs()


def test_probe_runs_wrapping_around_the_table_end(impl: Callable[..., Index]) -> None:
    """Keys whose home slot (Fibonacci hashing: top bits of h * GOLD) is the table's last or first slot at every
    capacity <= 1024, so probe runs wrap past the end and deletions shift entries across it."""
    gold = 0x9E3779B97F4A7C15
    inv = pow(gold, -1, 1 << 64)
    rng = np.random.default_rng(2)
    low = rng.integers(0, 1 << 50, size=12).tolist()
    keys = [((0xFFC0000000000000 + x) * inv) % (1 << 64) for x in low[:6]]  # home = last slot
    keys += [(x * inv) % (1 << 64) for x in low[6:]]  # home = slot 0
    assert all((k * gold) % (1 << 64) >> 54 in (0, 1023) for k in keys)
    idx, ref = impl(capacity=8), dict[str, set[int]]()
    for _ in range(3000):
        worker = f"w{int(rng.integers(2))}"
        hs = [keys[int(i)] for i in rng.integers(0, len(keys), size=int(rng.integers(1, 3)))]
        apply(idx, ref, ("store" if rng.random() < 0.5 else "remove", worker, hs))
        for k in keys:
            assert idx.find_matches([k]) == reference_matches(ref, [k])
    assert sorted(idx.iter_pairs()) == sorted((w, h) for w, s in ref.items() for h in s)


def test_long_queries_across_internal_chunks(impl: Callable[..., Index]) -> None:
    """Matches ending deep inside queries longer than the C core's 256-hash chunks, for array and list input."""
    rng = np.random.default_rng(3)
    chain = rng.integers(0, 2**64 - 1, size=1500, dtype=np.uint64)
    idx = impl()
    idx.store("a", None, chain[:1000])
    idx.store("b", None, chain[:300])
    idx.store("c", None, chain[:700])
    idx.remove("c", chain[520:521])
    idx.store("d", None, chain[1:])
    for i in range(5):  # spill the first blocks' holder sets
        idx.store(f"e{i}", None, chain[:257])
    want = {"a": 1000, "b": 300, "c": 520, **{f"e{i}": 257 for i in range(5)}}
    assert idx.find_matches(chain) == want
    assert idx.find_matches(chain.tolist()) == want
    assert idx.find_matches(chain[:1000]) == {**want, "a": 1000}
    assert idx.find_matches(chain[:256]) == {w: 256 for w in want}


def test_native_memory_per_pair_bound_without_sharing() -> None:
    """Worst case for the C core's memory: 256 workers, no block shared (one 16-byte slot per pair, table load
    down to 5/16 right after a doubling). Exact allocated bytes / pairs stays <= 60 at every size >= 20K pairs."""
    if NativePrefixIndex is None:
        pytest.skip("kvmesh.index._native is not built (pip install -e . compiles it)")
    rng = np.random.default_rng(4)
    idx = NativePrefixIndex()
    worst = 0.0
    for step in range(600):
        idx.store(f"w{step % 256}", None, rng.integers(0, 2**64 - 1, size=1000, dtype=np.uint64))
        if idx.num_pairs() >= 20_000:
            worst = max(worst, idx.nbytes() / idx.num_pairs())
    assert idx.num_pairs() == 600_000
    assert 16 < worst <= 60
