"""Prefix-index benchmark: ``python -m kvmesh.bench index --workers W --block-size B --blocks-per-worker N``.

Workload (the prefix-index work): 32 prefix groups, each with a random master prefix. A sequence of ``L`` tokens
(``L`` in 1024 / 8192 / 102400 with weights 0.6 / 0.3 / 0.1) is the first ``L/2`` tokens of its group's master
prefix followed by ``L/2`` unique random tokens. Sequences are drawn for each worker until it holds about
``N`` blocks; a worker stores only the blocks it does not hold yet (its leading master blocks are shared), in
events of up to 32 blocks, and the events of all workers are interleaved round-robin. Queries: per length,
90 % are stored sequences, 10 % random token streams that miss from the first block.

Prints one JSON line: ``build``, ``find_matches.<L>``, ``hashing.<L>`` (tokens as the adapter's native input:
a numpy array for kvmesh), ``hashing_list.<L>`` (tokens as a Python list), ``bytes_per_worker_block``, ``churn``,
``recovery_s_per_million_pairs`` (see docs/benchmarks.md). The same workload drives the Dynamo comparison
(``scripts/compare_dynamo_index.py``) through the :class:`Adapter` interface.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvmesh.index import NativePrefixIndex, NumpyPrefixIndex, PrefixIndex
from kvmesh.index.hashing import compute_block_hashes, make_salt

GROUPS = 32
LENGTHS = (1024, 8192, 102400)
WEIGHTS = (0.6, 0.3, 0.1)
VOCAB = 128_000
EVENT_BLOCKS = 32
QUERIES = {1024: 600, 8192: 300, 102400: 120}  # per length, 10 % misses; many samples: shared-CPU noise
HASH_CALLS = {1024: 2000, 8192: 400, 102400: 40}
CHURN_EVENTS = 2000  # leaf events evicted and re-stored
SALT = make_salt("bench-model")


@dataclass
class Event:
    """Worker ``worker`` stores blocks ``[b0, b1)`` of sequence ``seq``."""

    worker: int
    seq: int
    b0: int
    b1: int


@dataclass
class Workload:
    workers: int
    block_size: int
    blocks_per_worker: int
    seed: int
    masters: npt.NDArray[np.int64]
    seq_group: list[int] = field(default_factory=list)
    seq_len: list[int] = field(default_factory=list)
    hashes: list[npt.NDArray[np.uint64]] = field(default_factory=list)  # kvmesh chained hashes per sequence
    events: list[Event] = field(default_factory=list)
    misses: dict[int, list[npt.NDArray[np.int64]]] = field(default_factory=dict)

    def tokens(self, seq: int) -> npt.NDArray[np.int64]:
        """Sequence ``seq``'s tokens (regenerated from the seed; not kept in memory)."""
        length = self.seq_len[seq]
        half = length // 2
        rng = np.random.default_rng([self.seed, 1, seq])
        uniq = rng.integers(0, VOCAB, size=length - half)
        return np.concatenate([self.masters[self.seq_group[seq], :half], uniq])

    def seqs_of_length(self, length: int) -> list[int]:
        return [i for i, n in enumerate(self.seq_len) if n == length]


def make_workload(workers: int, block_size: int, blocks_per_worker: int, seed: int) -> Workload:
    rng = np.random.default_rng(seed)
    masters = rng.integers(0, VOCAB, size=(GROUPS, max(LENGTHS) // 2))
    wl = Workload(workers, block_size, blocks_per_worker, seed, masters)
    per_worker: list[list[Event]] = []
    for w in range(workers):
        held_master = [0] * GROUPS  # leading master blocks of each group this worker holds
        held, evs = 0, []
        while held < blocks_per_worker:
            seq = len(wl.seq_len)
            group = int(rng.integers(GROUPS))
            length = int(rng.choice(LENGTHS, p=WEIGHTS))
            wl.seq_group.append(group)
            wl.seq_len.append(length)
            hs = compute_block_hashes(wl.tokens(seq), block_size, SALT)
            wl.hashes.append(hs)
            shared = (length // 2) // block_size
            start = min(held_master[group], shared)
            held_master[group] = max(held_master[group], shared)
            for b0 in range(start, hs.shape[0], EVENT_BLOCKS):
                evs.append(Event(w, seq, b0, min(hs.shape[0], b0 + EVENT_BLOCKS)))
            held += hs.shape[0] - start
        per_worker.append(evs)
    longest = max(len(e) for e in per_worker)
    wl.events = [evs[i] for i in range(longest) for evs in per_worker if i < len(evs)]
    for length in LENGTHS:
        n_miss = max(1, QUERIES[length] // 10)
        wl.misses[length] = [rng.integers(0, VOCAB, size=length) for _ in range(n_miss)]
    return wl


class Adapter(Protocol):
    """What the benchmark needs from an index implementation (kvmesh here, Dynamo in the compare script)."""

    name: str

    def hash_input(self, tokens: npt.NDArray[np.int64]) -> Any: ...
    def hash(self, prepared: Any) -> Any: ...
    def store_payloads(self, wl: Workload, events: Sequence[Event]) -> list[Any]: ...
    def remove_payloads(self, wl: Workload, events: Sequence[Event]) -> list[Any]: ...
    def apply(self, payload: Any) -> None: ...
    def query_input(self, wl: Workload, seq: int | None, tokens: npt.NDArray[np.int64] | None) -> Any: ...
    def query(self, prepared: Any) -> dict[Any, int]: ...
    def memory_bytes(self) -> int | None: ...
    def num_pairs(self) -> int: ...
    def recovery_seconds(self) -> float: ...


class KvmeshAdapter:
    name = "kvmesh"

    def __init__(self, block_size: int, index_cls: Any = PrefixIndex) -> None:
        self.block_size = block_size
        self.index_cls = index_cls
        self.index = index_cls()
        self.name = "kvmesh-" + ("native" if index_cls is NativePrefixIndex else "numpy")

    def hash_input(self, tokens: npt.NDArray[np.int64]) -> Any:
        return tokens

    def hash(self, prepared: Any) -> Any:
        return compute_block_hashes(prepared, self.block_size, SALT)

    def store_payloads(self, wl: Workload, events: Sequence[Event]) -> list[Any]:
        out = []
        for ev in events:
            hs = wl.hashes[ev.seq]
            parent = int(hs[ev.b0 - 1]) if ev.b0 else None
            out.append((True, f"w{ev.worker}", parent, hs[ev.b0 : ev.b1]))
        return out

    def remove_payloads(self, wl: Workload, events: Sequence[Event]) -> list[Any]:
        return [(False, f"w{ev.worker}", None, wl.hashes[ev.seq][ev.b0 : ev.b1]) for ev in events]

    def apply(self, payload: Any) -> None:
        is_store, worker, parent, hs = payload
        if is_store:
            self.index.store(worker, parent, hs)
        else:
            self.index.remove(worker, hs)

    def query_input(self, wl: Workload, seq: int | None, tokens: npt.NDArray[np.int64] | None) -> Any:
        if seq is not None:
            return wl.hashes[seq]
        assert tokens is not None
        return compute_block_hashes(tokens, self.block_size, SALT)

    def query(self, prepared: Any) -> dict[Any, int]:
        return self.index.find_matches(prepared)

    def memory_bytes(self) -> int | None:
        return self.index.nbytes()

    def num_pairs(self) -> int:
        return self.index.num_pairs()

    def recovery_seconds(self) -> float:
        data = self.index.snapshot()
        t0 = time.perf_counter()
        restored = self.index_cls.restore(data)
        dt = time.perf_counter() - t0
        assert restored.num_pairs() == self.index.num_pairs()
        return dt


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def run(adapter: Adapter, wl: Workload) -> dict[str, Any]:
    """Run every phase against ``adapter``; returns the JSON-able result."""
    rng = np.random.default_rng([wl.seed, 2])
    result: dict[str, Any] = {
        "impl": adapter.name,
        "workers": wl.workers,
        "block_size": wl.block_size,
        "blocks_per_worker": wl.blocks_per_worker,
        "seed": wl.seed,
        "python": platform.python_version(),
    }
    # --- build
    payloads = adapter.store_payloads(wl, wl.events)
    nblocks = sum(ev.b1 - ev.b0 for ev in wl.events)
    gc.collect()
    rss0 = _rss_bytes()
    t0 = time.perf_counter()
    for p in payloads:
        adapter.apply(p)
    dt = time.perf_counter() - t0
    gc.collect()
    rss_delta = _rss_bytes() - rss0
    del payloads
    pairs = adapter.num_pairs()
    result["build"] = {
        "blocks_per_s": nblocks / dt,
        "events_per_s": len(wl.events) / dt,
        "events": len(wl.events),
        "blocks": nblocks,
        "pairs": pairs,
        "seconds": dt,
    }
    mem = adapter.memory_bytes()
    result["bytes_per_worker_block"] = (mem / pairs) if mem is not None else None
    result["rss_bytes_per_worker_block"] = rss_delta / pairs
    # --- find_matches
    fm: dict[str, Any] = {}
    for length in LENGTHS:
        pool = wl.seqs_of_length(length)
        n_hit = QUERIES[length] - len(wl.misses[length])
        hits = [int(s) for s in rng.choice(pool, size=n_hit)] if pool else []
        queries = [adapter.query_input(wl, s, None) for s in hits]
        queries += [adapter.query_input(wl, None, t) for t in wl.misses[length]]
        order = rng.permutation(len(queries))
        for q in queries[:5]:
            adapter.query(q)
        lat: list[float] = []
        matched = 0
        for i in order.tolist():
            t0n = time.perf_counter_ns()
            r = adapter.query(queries[i])
            lat.append((time.perf_counter_ns() - t0n) / 1e3)
            matched += bool(r)
        fm[str(length)] = {
            "ops_per_s": 1e6 * len(lat) / sum(lat),
            "p50_us": _pct(lat, 50),
            "p99_us": _pct(lat, 99),
            "queries": len(lat),
            "hit_queries": matched,
        }
    result["find_matches"] = fm
    # --- hashing: tokens -> block hashes, from the adapter's preferred input and from a Python list
    for key, prep in (("hashing", adapter.hash_input), ("hashing_list", lambda t: t.tolist())):
        hashing: dict[str, Any] = {}
        for length in LENGTHS:
            pool = wl.seqs_of_length(length)[:8]
            toks = [wl.tokens(s) for s in pool] or wl.misses[length]
            inputs = [prep(t) for t in toks]
            for x in inputs:
                adapter.hash(x)
            lat = []
            for i in range(HASH_CALLS[length]):
                x = inputs[i % len(inputs)]
                t0n = time.perf_counter_ns()
                adapter.hash(x)
                lat.append((time.perf_counter_ns() - t0n) / 1e3)
            hashing[str(length)] = {"ops_per_s": 1e6 * len(lat) / sum(lat), "p50_us": _pct(lat, 50)}
        result[key] = hashing
    # --- churn: evict the last event (a leaf: up to 32 tail blocks) of random stored sequences, then store
    # them again. Leaves only, because a radix tree (Dynamo) drops a removed block's descendants too.
    last: dict[tuple[int, int], Event] = {}
    for ev in wl.events:
        last[(ev.worker, ev.seq)] = ev
    leaves = list(last.values())
    k = min(CHURN_EVENTS, len(leaves))
    evs = [leaves[i] for i in sorted(rng.choice(len(leaves), size=k, replace=False).tolist())]
    nchurn = sum(ev.b1 - ev.b0 for ev in evs)
    removes = adapter.remove_payloads(wl, evs)
    stores = adapter.store_payloads(wl, evs)
    t0 = time.perf_counter()
    for p in removes:
        adapter.apply(p)
    t_rm = time.perf_counter() - t0
    t0 = time.perf_counter()
    for p in stores:
        adapter.apply(p)
    t_st = time.perf_counter() - t0
    result["churn"] = {"remove_blocks_per_s": nchurn / t_rm, "store_blocks_per_s": nchurn / t_st}
    if adapter.num_pairs() != pairs:
        raise RuntimeError(f"churn changed the index: {adapter.num_pairs()} != {pairs} pairs")
    # --- recovery
    result["recovery_s_per_million_pairs"] = adapter.recovery_seconds() * 1e6 / pairs
    return result


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m kvmesh.bench index", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks-per-worker", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--impl", choices=("auto", "native", "numpy"), default="auto", help="index core (auto: native when built)"
    )
    return ap.parse_args(list(argv))


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    wl = make_workload(args.workers, args.block_size, args.blocks_per_worker, args.seed)
    cls = {"auto": PrefixIndex, "native": NativePrefixIndex, "numpy": NumpyPrefixIndex}[args.impl]
    if cls is None:
        raise SystemExit("--impl native: kvmesh.index._native is not built (pip install -e . compiles it)")
    print(json.dumps(run(KvmeshAdapter(args.block_size, cls), wl)), flush=True)
    return 0
