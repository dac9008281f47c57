"""The evaluation protocol on traces it was not tuned on: unservable requests, capacity 0, the common load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.bench.fleet import main as fleet_main

pytestmark = pytest.mark.unit

CONTEXT = 131_072


def write_mooncake(path: Path, rows: list[tuple[int, int, int, list[int]]]) -> Path:
    """Rows of (timestamp ms, input_length, output_length, hash_ids) as a Mooncake JSONL file."""
    with path.open("w") as f:
        for ts, n_in, n_out, ids in rows:
            f.write(json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}))
            f.write("\n")
    return path


def small_trace_with_overlong(path: Path, overlong: int = 3) -> Path:
    """24 short prompts (1.5–3K tokens, two shared system prefixes) over 60 s, and ``overlong`` prompts longer
    than the model's context (131,072 tokens), like the held-out trace of issue 14."""
    rows: list[tuple[int, int, int, list[int]]] = []
    nxt = 1000
    for i in range(24):
        n_in = 1536 + 512 * (i % 4)
        own = list(range(nxt, nxt + 4))
        nxt += 4
        ids = [i % 2, 2 + i % 2, *own][: -(-n_in // 512)]
        rows.append((2500 * i, n_in, 16 + i % 5, ids))
    for j in range(overlong):
        n_in = CONTEXT + 4096 + 512 * j
        k = -(-n_in // 512)
        rows.append((2500 * (3 + 7 * j) + 1, n_in, 32, list(range(nxt, nxt + k))))
        nxt += k
    rows.sort(key=lambda r: r[0])
    return write_mooncake(path, rows)


def run_bench(trace: Path, out: Path, *extra: str) -> dict[str, object]:
    argv = ["--trace", str(trace), "--workers", "2", "--policies", "round_robin,kvmesh", "--out", str(out)]
    argv += ["--skip-studies", "--bisect-window-s", "0", "--jobs", "1", *extra]
    assert fleet_main(argv) == 0
    res: dict[str, object] = json.loads((out / "results.json").read_text())
    return res


def test_a_trace_with_prompts_beyond_the_context_gives_a_report(tmp_path: Path) -> None:
    """Issue 14: before the fix this raised ``RuntimeError: round_robin never meets the SLO``."""
    trace = small_trace_with_overlong(tmp_path / "t.jsonl")
    res = run_bench(trace, tmp_path / "out")
    assert (tmp_path / "out" / "report.md").is_file()
    assert res["round_robin"]["slo_capacity"] > 0  # type: ignore[index]
    assert res["load_scale"] > 0  # type: ignore[operator]
