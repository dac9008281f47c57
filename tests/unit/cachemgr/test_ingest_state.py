"""Ingestion state machine: in-order, gaps → replay, replay failure → full dump, restarts, duplicates.

`ToyEngine` is a stand-in for an engine's prefix cache (the real ones are exercised by the vLLM and
worker tests): it holds blocks under a per-process *seeded* engine hash, emits numbered event batches,
and knows the ground truth: the index hash of every block it holds (`hasher.chain(None, prefix)`).
`SetIndex` is a stand-in index (sets per worker) used to compare with that truth exactly.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Sequence

import pytest

from kvmesh.cachemgr.ingest import Ingestor, Phase
from kvmesh.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, KvEventBatch

BS = 4
# Engines stamp batches with the wall clock: one clock for every ToyEngine, so a later incarnation's batches
# are stamped later than an earlier one's (the ingestor orders incarnations by it).
WALL_CLOCK = itertools.count(1)


class RefHasher:
    """Chained blake2b over (parent, tokens, lora): the reference `BlockHasher` semantics."""

    def chain(
        self,
        parent: int | None,
        token_ids: Sequence[int],
        block_size: int,
        lora_name: str | None,
        tenant: str | None = None,
    ) -> list[int]:
        out, h = [], parent
        if h is None and tenant:
            h = int.from_bytes(hashlib.blake2b(tenant.encode(), digest_size=8).digest(), "big")
        for i in range(0, len(token_ids) - len(token_ids) % block_size, block_size):
            m = hashlib.blake2b(repr((h, lora_name, tuple(token_ids[i : i + block_size]))).encode(), digest_size=8)
            h = int.from_bytes(m.digest(), "big")
            out.append(h)
        return out


def make_hasher() -> object:
    """The real `IndexHasher` when `kvmesh.index.hashing` is present, else the reference one."""
    try:
        from kvmesh.cachemgr.hasher import IndexHasher

        h = IndexHasher("toy-model")
        h.chain(None, list(range(BS)), BS, None)
        return h
    except (ImportError, AttributeError, TypeError):
        return RefHasher()


class SetIndex:
    """Stand-in index: worker → set of index hashes (and the parent of each, to check chaining)."""

    def __init__(self) -> None:
        self.held: dict[str, set[int]] = {}
        self.parent: dict[int, int | None] = {}

    def store(self, worker: str, parent: int | None, hashes: Sequence[int]) -> None:
        s = self.held.setdefault(worker, set())
        p = parent
        for h in hashes:
            s.add(h)
            self.parent[h] = p
            p = h

    def remove(self, worker: str, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.held.get(worker, set()).discard(h)

    def clear(self, worker: str) -> None:
        self.held.pop(worker, None)


class ToyEngine:
    """Stand-in engine prefix cache emitting KV events with seeded (private) engine hashes."""

    def __init__(self, worker: str, hasher: object, seed: int, instance: str = "i0") -> None:
        self.worker, self.hasher, self.seed, self.instance = worker, hasher, seed, instance
        self.seq = 0
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # engine hash → (parent eh, prefix)
        self.copies: dict[int, int] = {}

    def ehash(self, parent: int | None, toks: Sequence[int]) -> int:
        m = hashlib.sha256(repr((self.seed, parent, tuple(toks))).encode()).digest()
        return int.from_bytes(m[:8], "big")

    def batch(self, events: list[KvEvent]) -> KvEventBatch:
        b = KvEventBatch(self.worker, self.instance, self.seq, float(next(WALL_CLOCK)), tuple(events))
        self.seq += 1
        return b

    def prompt(self, tokens: Sequence[int]) -> KvEventBatch:
        """Cache every full block of `tokens` not already held (one BlockStored per new run)."""
        events: list[KvEvent] = []
        parent: int | None = None
        run: list[int] = []
        run_parent: int | None = None
        run_toks: list[int] = []
        for i in range(0, len(tokens) - len(tokens) % BS, BS):
            eh = self.ehash(parent, tokens[i : i + BS])
            if eh not in self.blocks:
                if not run:
                    run_parent = parent
                self.blocks[eh] = (parent, tuple(tokens[: i + BS]))
                self.copies[eh] = 1
                run.append(eh)
                run_toks += tokens[i : i + BS]
            elif run:
                events.append(BlockStored(tuple(run), run_parent, tuple(run_toks), BS))
                run, run_toks = [], []
            parent = eh
        if run:
            events.append(BlockStored(tuple(run), run_parent, tuple(run_toks), BS))
        return self.batch(events)

    def evict(self, n: int, rng: random.Random) -> KvEventBatch:
        """Evict up to n random blocks (any order: children may outlive parents)."""
        victims = rng.sample(sorted(self.blocks), min(n, len(self.blocks)))
        for v in victims:
            del self.blocks[v]
            del self.copies[v]
        return self.batch([BlockRemoved(tuple(victims))])

    def clear(self) -> KvEventBatch:
        self.blocks.clear()
        self.copies.clear()
        return self.batch([AllBlocksCleared()])

    def dump(self) -> list[KvEvent]:
        """Full dump (set semantics): each held block's chain from the root, then the unheld ancestors removed."""
        out: list[KvEvent] = []
        unheld: set[int] = set()
        for eh, (_p, prefix) in sorted(self.blocks.items(), key=lambda kv: len(kv[1][1])):
            chain: list[int] = []
            p: int | None = None
            for i in range(0, len(prefix), BS):
                p = self.ehash(p, prefix[i : i + BS])
                chain.append(p)
            assert chain[-1] == eh
            unheld.update(a for a in chain if a not in self.blocks)
            out.append(BlockStored(tuple(chain), None, tuple(prefix), BS))
        out.append(BlockRemoved(tuple(sorted(unheld))))
        return out

    def truth(self) -> set[int]:
        """Index hashes of every held block."""
        return {
            self.hasher.chain(None, prefix, BS, None)[-1]  # type: ignore[attr-defined]
            for _p, prefix in self.blocks.values()
        }


@pytest.fixture
def setup() -> tuple[SetIndex, Ingestor, ToyEngine]:
    idx = SetIndex()
    hasher = make_hasher()
    ing = Ingestor(idx, hasher, BS)  # type: ignore[arg-type]
    return idx, ing, ToyEngine("w1", hasher, seed=1)


def held(idx: SetIndex, w: str = "w1") -> set[int]:
    return idx.held.get(w, set())


@pytest.mark.unit
def test_in_order_matches_truth_and_removals_map_engine_hashes(setup: tuple) -> None:
    idx, ing, eng = setup
    rng = random.Random(0)
    for i in range(20):
        r = ing.apply(eng.prompt([1, 2, 3, 4] * 3 + list(range(i, i + 13))))
        assert r.resync is None and r.applied == [eng.seq - 1]
        if i % 3 == 2:
            ing.apply(eng.evict(4, rng))
        assert held(idx) == eng.truth()
    assert len(eng.truth()) > 10
    # a shared prefix chains under the same parent index hash
    root = make_hasher().chain(None, [1, 2, 3, 4] * 3, BS, None)  # type: ignore[attr-defined]
    assert idx.parent[root[1]] == root[0]


@pytest.mark.unit
def test_index_hashes_are_independent_of_engine_seed() -> None:
    idx, hasher = SetIndex(), make_hasher()
    ing = Ingestor(idx, hasher, BS)  # type: ignore[arg-type]
    a, b = ToyEngine("a", hasher, seed=11), ToyEngine("b", hasher, seed=99)
    toks = list(range(40))
    ba, bb = a.prompt(toks), b.prompt(toks)
    assert ba.events != bb.events  # different private engine hashes ...
    ing.apply(ba)
    ing.apply(bb)
    assert held(idx, "a") == held(idx, "b") and len(held(idx, "a")) == 10  # ... same index hashes


@pytest.mark.unit
def test_gap_requests_replay_and_replay_restores_exact_index(setup: tuple) -> None:
    idx, ing, eng = setup
    b0 = eng.prompt(list(range(16)))
    b1 = eng.prompt(list(range(16)) + [7] * 8)
    b2 = eng.prompt(list(range(100, 112)))
    ing.apply(b0)
    before = set(held(idx))
    r = ing.apply(b2)  # b1 lost
    assert r.gap and r.resync is not None and not r.resync.full_dump and r.resync.from_sequence == 1
    assert ing.workers["w1"].phase is Phase.REPLAYING
    assert held(idx) == before  # nothing past the gap applied: lagging, never wrong
    r = ing.apply(b1)  # the replay
    assert r.applied == [1, 2]
    assert ing.workers["w1"].phase is Phase.SYNCED
    assert held(idx) == eng.truth()
    assert ing.apply(b2).ignored == [(2, "duplicate")]  # replay overlapping live traffic


@pytest.mark.unit
def test_replay_failure_escalates_to_full_dump(setup: tuple) -> None:
    idx, ing, eng = setup
    ing.apply(eng.prompt(list(range(20))))
    eng.prompt(list(range(50, 70)))  # lost, and the worker cannot replay it
    r = ing.apply(eng.prompt(list(range(200, 212))))
    assert r.resync and not r.resync.full_dump
    r = ing.replay_failed("w1")
    assert r.resync and r.resync.full_dump
    assert held(idx) == set()  # dropped, not wrong
    live_during_dump = None
    ing.begin_dump("w1", "i0")
    ing.apply_dump("w1", eng.dump())
    next_seq = eng.seq
    live_during_dump = eng.prompt(list(range(300, 308)))
    ing.apply(live_during_dump)  # buffered until the dump ends
    assert ing.workers["w1"].phase is Phase.DUMPING
    r = ing.end_dump("w1", next_seq)
    assert r.applied == [next_seq]
    assert held(idx) == eng.truth()
    assert ing.workers["w1"].phase is Phase.SYNCED


@pytest.mark.unit
def test_restart_with_new_instance_drops_old_entries(setup: tuple) -> None:
    idx, ing, eng = setup
    ing.apply(eng.prompt(list(range(32))))
    assert held(idx)
    fresh = ToyEngine("w1", eng.hasher, seed=5, instance="i1")
    r = ing.apply(fresh.prompt(list(range(8))))
    assert r.restart and r.resync is None
    assert held(idx) == fresh.truth() and len(held(idx)) == 2
    # a restarted worker whose first batch we missed: gap from 0
    fresh2 = ToyEngine("w1", eng.hasher, seed=6, instance="i2")
    fresh2.prompt(list(range(8)))
    r = ing.apply(fresh2.prompt(list(range(8, 16))))
    assert r.restart and r.resync and r.resync.from_sequence == 0
    assert held(idx) == set()


@pytest.mark.unit
@pytest.mark.parametrize("current_by", ["batch", "dump"])
def test_late_batch_of_an_unseen_earlier_incarnation_is_ignored(setup: tuple, current_by: str) -> None:
    """Two restarts in a row: a batch of the middle incarnation (never seen) arrives after the newest one's
    batch or dump. It is older (stamped earlier), so it neither retires the live instance nor enters the
    index; the live instance's later batches still apply. (Found by test_ingest_random, seed 3296495.)"""
    idx, ing, eng = setup
    ing.apply(eng.prompt(list(range(8))))
    middle = ToyEngine("w1", eng.hasher, seed=5, instance="i1")
    late = middle.prompt(list(range(100, 108)))  # delayed in the network
    newest = ToyEngine("w1", eng.hasher, seed=6, instance="i2")
    if current_by == "batch":
        assert ing.apply(newest.prompt(list(range(8, 16)))).restart
    else:
        ing.begin_dump("w1", "i2", float(next(WALL_CLOCK)))
        ing.apply_dump("w1", newest.dump())
        ing.end_dump("w1", newest.seq)
    r = ing.apply(late)
    assert not r.restart and r.ignored == [(0, "retired instance")]
    assert ing.workers["w1"].instance_id == "i2"
    r = ing.apply(newest.prompt(list(range(16, 24))))
    assert r.applied and held(idx) == newest.truth()
    assert ing.apply(middle.prompt(list(range(108, 116)))).ignored  # the middle one is remembered as retired


@pytest.mark.unit
def test_duplicates_and_old_batches_are_ignored(setup: tuple) -> None:
    idx, ing, eng = setup
    bs = [eng.prompt(list(range(i, i + 8))) for i in range(0, 40, 8)]
    for b in bs:
        ing.apply(b)
    snap = set(held(idx))
    stale_removal = KvEventBatch("w1", "i0", 1, 0.0, (AllBlocksCleared(),))
    for b in [*bs, stale_removal]:
        assert ing.apply(b).ignored
    assert held(idx) == snap == eng.truth()


@pytest.mark.unit
def test_unknown_parent_requests_dump_instead_of_guessing(setup: tuple) -> None:
    idx, ing, _eng = setup
    bad = KvEventBatch("w1", "i0", 0, 0.0, (BlockStored((5,), 12345, (1, 2, 3, 4), BS),))
    r = ing.apply(bad)
    assert r.resync and r.resync.full_dump and held(idx) == set()


@pytest.mark.unit
def test_same_engine_hash_in_two_blocks_needs_two_removals(setup: tuple) -> None:
    idx, ing, eng = setup
    toks = tuple(range(4))
    eh = eng.ehash(None, toks)
    ing.apply(eng.batch([BlockStored((eh,), None, toks, BS), BlockStored((eh,), None, toks, BS)]))
    ing.apply(eng.batch([BlockRemoved((eh,))]))
    assert len(held(idx)) == 1
    ing.apply(eng.batch([BlockRemoved((eh,))]))
    assert held(idx) == set()


@pytest.mark.unit
def test_buffer_overflow_escalates(setup: tuple) -> None:
    idx, _ing, eng = setup
    ing = Ingestor(idx, eng.hasher, BS, max_pending=3)
    ing.apply(eng.prompt(list(range(8))))
    eng.prompt([9] * 8)
    results = [ing.apply(eng.prompt([i] * 4)) for i in range(20, 24)]
    assert results[-1].resync and results[-1].resync.full_dump
    assert ing.pending_resyncs()[0].full_dump


@pytest.mark.unit
def test_real_hasher_chain_equals_full_prefix_hashes() -> None:
    from kvmesh.cachemgr.hasher import IndexHasher
    from kvmesh.index import hashing

    h = IndexHasher("m", tenant="t")
    toks = list(range(1000, 1040))
    full = [int(x) for x in hashing.compute_block_hashes(toks, BS, salt=hashing.make_salt("m", None, "t"))]
    head = h.chain(None, toks[:12], BS, None)
    assert head + h.chain(head[-1], toks[12:], BS, None) == full
    assert h.chain(None, toks, BS, "lora-a") != full  # the adapter salts the chain
    assert isinstance(make_hasher(), IndexHasher)


@pytest.mark.unit
def test_cache_reset_is_a_resync_point_for_engines_without_dumps(setup: tuple) -> None:
    idx, ing, eng = setup
    ing.apply(eng.prompt(list(range(20))))
    eng.prompt(list(range(40, 60)))  # lost
    ing.apply(eng.prompt(list(range(60, 64))))
    assert ing.replay_failed("w1").resync.full_dump  # type: ignore[union-attr]
    r = ing.apply(eng.prompt(list(range(80, 88))))  # still no dump: buffered, not applied
    assert r.buffered and held(idx) == set()
    r = ing.apply(eng.clear())  # the engine reset its cache (vLLM: /reset_prefix_cache)
    assert r.applied and ing.workers["w1"].phase is Phase.SYNCED
    ing.apply(eng.prompt(list(range(8))))
    assert held(idx) == eng.truth() and len(held(idx)) == 2


@pytest.mark.unit
def test_a_dumped_block_whose_parent_was_evicted_is_skipped_not_a_dump_refused(setup: tuple) -> None:
    # a worker's mirror dumps the blocks it holds; one whose parent it evicted has no chain from the root. A
    # dump refused for it would be asked for again and refused again: the worker would vanish from the index
    idx, ing, eng = setup
    eng.prompt(list(range(20)))
    orphan = BlockStored((99,), 12345, tuple(range(500, 504)), BS)
    child = BlockStored((100,), 99, tuple(range(504, 508)), BS)
    ing.begin_dump("w1", "i0")
    r = ing.apply_dump("w1", [*eng.dump(), orphan, child])
    assert not r.resync
    r = ing.end_dump("w1", eng.seq)
    assert not r.resync and ing.workers["w1"].phase is Phase.SYNCED
    assert held(idx) == eng.truth() and len(held(idx)) == 20 // BS
