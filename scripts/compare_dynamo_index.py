#!/usr/bin/env python3
"""Run the kvmesh index benchmark workload against NVIDIA Dynamo's radix tree and print the same JSON keys.

    python scripts/compare_dynamo_index.py --workers 64 --block-size 16 --blocks-per-worker 20000 --seed 0

The peer is never a kvmesh dependency: on first use this script creates its own venv (``--venv``, default
/tmp/dynamo-venv) with ``ai-dynamo-runtime`` and ``numpy`` and re-executes itself there, importing kvmesh's
pure modules (hashing, index, bench workload) straight from ``libs/``. Dynamo side:

* tokens -> hashes: ``dynamo.llm.compute_block_hash_for_seq(tokens: list[int], block_size)``;
* index: ``dynamo.llm.RadixTree``: ``apply_event(worker_id, json bytes)`` with ``stored`` events
  (``block_hash`` = kvmesh's chained hash, ``tokens_hash`` = Dynamo's per-block hash, ``parent_hash``) and
  ``removed`` events; ``find_matches(list of per-block hashes)``; recovery = ``dump_tree_as_events`` replayed
  into a fresh tree (Dynamo has no binary snapshot).

Event payloads and query lists are prepared before the clock starts (Dynamo is timed on ``apply_event`` and
``find_matches`` only). Dynamo's memory is not visible to Python: ``rss_bytes_per_worker_block`` (RSS growth
during the build / pairs) is reported for both, ``bytes_per_worker_block`` only where it can be counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PEER = "ai-dynamo-runtime==1.6.1"


def _ensure_venv(venv: Path) -> None:
    py = venv / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(py), "-c", "import dynamo.llm, numpy"], capture_output=True)
    if probe.returncode != 0:
        subprocess.run([str(py), "-m", "pip", "install", "-q", PEER, "numpy"], check=True)


def main(argv: Sequence[str]) -> int:
    venv = Path(os.environ.get("DYNAMO_VENV", "/tmp/dynamo-venv"))
    if os.environ.get("KVMESH_IN_DYNAMO_VENV") != "1":
        _ensure_venv(venv)
        env = dict(os.environ, KVMESH_IN_DYNAMO_VENV="1")
        cmd = [str(venv / "bin" / "python"), __file__, *argv]
        return subprocess.run(cmd, env=env).returncode
    sys.path.insert(0, str(ROOT / "libs"))
    return _run_in_venv(argv)


def _run_in_venv(argv: Sequence[str]) -> int:
    import numpy as np
    from dynamo.llm import RadixTree, compute_block_hash_for_seq

    from kvmesh.bench import index as bench

    class DynamoAdapter:
        name = "dynamo-" + PEER.split("==")[1]

        def __init__(self, wl: bench.Workload) -> None:
            self.block_size = wl.block_size
            self.tree = RadixTree()
            self.local: dict[int, list[int]] = {}
            self.event_id = 0
            self.pairs = sum(ev.b1 - ev.b0 for ev in wl.events)

        def _local(self, wl: bench.Workload, seq: int) -> list[int]:
            got = self.local.get(seq)
            if got is None:
                got = compute_block_hash_for_seq(wl.tokens(seq).tolist(), self.block_size)
                self.local[seq] = got
            return got

        def hash_input(self, tokens: Any) -> Any:
            return tokens.tolist()

        def hash(self, prepared: Any) -> Any:
            return compute_block_hash_for_seq(prepared, self.block_size)

        def _event(self, data: dict[str, Any]) -> bytes:
            self.event_id += 1
            return json.dumps({"event_id": self.event_id, "data": data, "dp_rank": 0}).encode()

        def store_payloads(self, wl: bench.Workload, events: Sequence[bench.Event]) -> list[Any]:
            out = []
            for ev in events:
                ext = wl.hashes[ev.seq]
                loc = self._local(wl, ev.seq)
                blocks = [{"block_hash": int(ext[i]), "tokens_hash": loc[i]} for i in range(ev.b0, ev.b1)]
                parent = int(ext[ev.b0 - 1]) if ev.b0 else None
                out.append((ev.worker, self._event({"stored": {"parent_hash": parent, "blocks": blocks}})))
            return out

        def remove_payloads(self, wl: bench.Workload, events: Sequence[bench.Event]) -> list[Any]:
            return [
                (ev.worker, self._event({"removed": {"block_hashes": wl.hashes[ev.seq][ev.b0 : ev.b1].tolist()}}))
                for ev in events
            ]

        def apply(self, payload: Any) -> None:
            self.tree.apply_event(payload[0], payload[1])

        def query_input(self, wl: bench.Workload, seq: int | None, tokens: Any) -> Any:
            if seq is not None:
                return self._local(wl, seq)
            return compute_block_hash_for_seq(tokens.tolist(), self.block_size)

        def query(self, prepared: Any) -> dict[Any, int]:
            return self.tree.find_matches(prepared).scores

        def memory_bytes(self) -> int | None:
            return None

        def num_pairs(self) -> int:
            return self.pairs

        def recovery_seconds(self) -> float:
            t0 = time.perf_counter()
            dump = self.tree.dump_tree_as_events()
            t_dump = time.perf_counter() - t0
            payloads = []
            for line in dump:
                rec = json.loads(line)
                payloads.append((rec["worker_id"], json.dumps(rec["event"]).encode()))
            fresh = RadixTree()
            t0 = time.perf_counter()
            for wid, data in payloads:
                fresh.apply_event(wid, data)
            self.recovery_dump_s = t_dump
            return time.perf_counter() - t0

    args = bench.parse_args(argv)
    wl = bench.make_workload(args.workers, args.block_size, args.blocks_per_worker, args.seed)
    adapter = DynamoAdapter(wl)
    result = bench.run(adapter, wl)
    dump_s = adapter.recovery_dump_s
    result["recovery_note"] = f"replay of dump_tree_as_events into a fresh RadixTree (dump itself: {dump_s:.3f} s)"
    result["numpy"] = np.__version__
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
