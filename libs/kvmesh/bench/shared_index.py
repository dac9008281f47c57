"""``python -m kvmesh.bench shared-index``: one index replica for N router processes (`kvmesh.index.shared`).

A writer builds an index of `--blocks` distinct blocks over `--workers` workers (chains as long as the
longest query, each held by 1-6 workers, so that some spill), in shared memory and, for comparison, in a
private index. A reader process then maps it and answers `--queries` prefix queries of each length in
`--query-blocks` (a chain's leading blocks: every block is looked up); it reports the private memory
(smaps_rollup) its walks over the mapping cost, what a router process pays for its copy, and the median
microseconds per query, as the private index answers the same queries. One JSON line: bytes of the shared
files and of a private copy, the reader's private bytes, µs per query both ways.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvmesh.index.native_index import NativePrefixIndex
from kvmesh.index.shared import SharedIndexView, SharedPrefixIndex, remove_files


def _private_bytes() -> int:
    """This process's private memory (clean + dirty), from /proc/self/smaps_rollup."""
    total = 0
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            total += int(line.split()[1]) * 1024
    return total


def _chains(blocks: int, length: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(1, 2**63, size=(max(blocks // length, 1), length), dtype=np.uint64)


def _queries(chains: np.ndarray, n: int, length: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed + length)
    return [np.ascontiguousarray(chains[i, :length]) for i in rng.integers(len(chains), size=n)]


def _median_us(index: Any, queries: list[np.ndarray]) -> float:
    times = []
    for q in queries:
        t = time.perf_counter_ns()
        index.find_matches(q)
        times.append(time.perf_counter_ns() - t)
    return float(np.median(times)) / 1000


def _lengths(args: argparse.Namespace) -> list[int]:
    return [int(x) for x in args.query_blocks.split(",")]


def reader(args: argparse.Namespace) -> int:
    view = SharedIndexView(args.path)
    lengths = _lengths(args)
    chains = _chains(args.blocks, max(lengths), args.seed)
    queries = {n: _queries(chains, args.queries, n, args.seed) for n in lengths}
    before = _private_bytes()
    us = {str(n): round(_median_us(view, qs), 2) for n, qs in queries.items()}
    print(json.dumps({"private_bytes": _private_bytes() - before, "us": us, **view.stats()}))
    return 0


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmesh.bench shared-index")
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=1_000_000, help="distinct blocks (chains of 64)")
    ap.add_argument("--query-blocks", default="64,512", help="query lengths in blocks (comma-separated)")
    ap.add_argument("--queries", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--path", default="", help=argparse.SUPPRESS)  # the reader process's
    args = ap.parse_args(argv)
    if args.path:
        return reader(args)
    path = f"/dev/shm/kvmesh-bench-{uuid.uuid4().hex[:12]}"
    try:
        shared, private = SharedPrefixIndex(path), NativePrefixIndex()
        lengths = _lengths(args)
        chains = _chains(args.blocks, max(lengths), args.seed)
        rng = np.random.default_rng(args.seed + 1)
        t = time.perf_counter()
        for chain in chains:
            for w in rng.choice(args.workers, size=int(rng.integers(1, 7)), replace=False):
                shared.store(f"w{w}", None, chain)
        build_s = time.perf_counter() - t
        for chain in chains:
            for w in rng.choice(args.workers, size=int(rng.integers(1, 7)), replace=False):
                private.store(f"w{w}", None, chain)
        files = sum(f.stat().st_size for f in Path(path).parent.glob(Path(path).name + ".[sp]*"))
        own = {str(n): round(_median_us(private, _queries(chains, args.queries, n, args.seed)), 2) for n in lengths}
        cmd = [sys.executable, "-m", "kvmesh.bench", "shared-index", *argv, "--path", path]
        read = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        out = {
            "bench": "shared-index",
            "workers": args.workers,
            "blocks": int(shared.num_entries()),
            "pairs": int(shared.num_pairs()),
            "build_s": round(build_s, 2),
            "shared_file_bytes": files,
            "private_copy_bytes": private.nbytes(),
            "reader_private_bytes": read["private_bytes"],
            "query_us": {"private": own, "shared_reader": read["us"]},
            "reader_retries": read["retries"],
        }
        print(json.dumps(out))
    finally:
        remove_files(path)
    return 0
