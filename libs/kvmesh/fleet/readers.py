"""Readers of the public traces in ``shared/traces`` (see its README for the formats).

* Mooncake JSONL: ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``, one 512-token
  chunk id per block, chained. The ids become :class:`~kvmesh.fleet.trace.TraceRequest` chunks as they are.
* Azure LLM inference CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens`` — lengths only, so every request
  gets fresh chunk ids (unique tokens, no prefix sharing). Timestamps become seconds since the first row.

:func:`write_mooncake` writes a trace of open-loop requests in the Mooncake format (ids renumbered densely
from 0 in order of first use, as the public trace's are), so ``read_mooncake`` reads back the same prompts.
"""

from __future__ import annotations

import csv
import json
from datetime import datetime
from pathlib import Path

from kvmesh.fleet.trace import CHUNK_TOKENS, ChunkIds, Trace, TraceRequest

AZURE_NAMESPACE = 1


def read_mooncake(path: str | Path, limit: int | None = None) -> Trace:
    """Parse a Mooncake trace; raises ``ValueError`` on a line whose hash ids do not cover its prompt."""
    reqs: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(reqs) >= limit:
                break
            if not line.strip():
                continue
            row = json.loads(line)
            ids = tuple(int(h) for h in row["hash_ids"])
            n_in = int(row["input_length"])
            if len(ids) * CHUNK_TOKENS < n_in:
                raise ValueError(f"{path}:{lineno}: {len(ids)} hash ids cannot cover {n_in} tokens")
            reqs.append(
                TraceRequest(
                    index=len(reqs),
                    arrival_s=int(row["timestamp"]) / 1000.0,
                    input_len=n_in,
                    output_len=max(1, int(row["output_length"])),
                    chunks=ids,
                )
            )
    return Trace(Path(path).stem, reqs, {"source": "mooncake"})


def write_mooncake(trace: Trace, path: str | Path) -> int:
    """Write ``trace`` as Mooncake JSONL (timestamp in integer ms); returns the number of lines written.

    Raises ``ValueError`` on a closed-loop request (``follows``): the format has no such field.
    """
    dense: dict[int, int] = {}
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            if r.follows is not None:
                raise ValueError(f"request {r.index} follows {r.follows}: Mooncake traces are open-loop")
            ids = [dense.setdefault(c, len(dense)) for c in r.chunks[: -(-r.input_len // CHUNK_TOKENS)]]
            row = {"timestamp": round(r.arrival_s * 1000), "input_length": r.input_len}
            f.write(json.dumps({**row, "output_length": r.output_len, "hash_ids": ids}) + "\n")
    return len(trace)


def _parse_azure_ts(s: str) -> datetime:
    """``YYYY-MM-DD HH:MM:SS.fffffff`` (7 fractional digits) → datetime (microsecond precision)."""
    day, _, frac = s.strip().partition(".")
    return datetime.strptime(f"{day}.{(frac + '000000')[:6]}", "%Y-%m-%d %H:%M:%S.%f")


def read_azure(path: str | Path, limit: int | None = None) -> Trace:
    """Parse an Azure LLM inference CSV; every prompt gets unique chunk ids (no shared prefixes)."""
    alloc = ChunkIds(AZURE_NAMESPACE)
    reqs: list[TraceRequest] = []
    t0: datetime | None = None
    with open(path, encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            if limit is not None and len(reqs) >= limit:
                break
            ts = _parse_azure_ts(row["TIMESTAMP"])
            t0 = ts if t0 is None else t0
            n_in = max(1, int(row["ContextTokens"]))
            reqs.append(
                TraceRequest(
                    index=len(reqs),
                    arrival_s=(ts - t0).total_seconds(),
                    input_len=n_in,
                    output_len=max(1, int(row["GeneratedTokens"])),
                    chunks=alloc.take(-(-n_in // CHUNK_TOKENS)),
                )
            )
    return Trace(Path(path).stem, reqs, {"source": "azure"})


def read_trace(path: str | Path, limit: int | None = None) -> Trace:
    """Dispatch on the extension: ``.jsonl`` → Mooncake, ``.csv`` → Azure."""
    p = Path(path)
    if p.suffix == ".jsonl":
        return read_mooncake(p, limit)
    if p.suffix == ".csv":
        return read_azure(p, limit)
    raise ValueError(f"unknown trace format: {p.name} (want .jsonl or .csv)")
