"""Trace model shared by the readers, the synthetic generators and the fleet simulator.

A prompt is described by *chunks*: content ids of 512 consecutive tokens (the granularity of the
Mooncake trace's ``hash_ids``). Equal chunk ids at the same position mean equal content with an equal
prefix (the trace's chained-hash property), so expanding every id deterministically into 512 token ids
gives equal token blocks, hence equal chained block hashes, at every block size that divides 512.

Token expansion (pure, vectorised): token ``j`` of chunk ``c`` is
``splitmix64(c · 512 + j + 1) mod vocab_size``. A prompt is the concatenation of its chunks' tokens,
cut to ``input_len``; a last partial chunk therefore holds the leading tokens of its id's expansion
(the engine never caches a partial block, so it only matters at block sizes below 512).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

CHUNK_TOKENS = 512
DEFAULT_VOCAB = 128_256  # Llama-3 vocabulary, the model family of the simulated 70B
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. ``arrival_s`` is relative to the trace start (ignored if ``follows``).

    ``follows``: index of an earlier request of the same client; this one arrives ``think_s`` after that
    one completes (closed-loop clients, multi-turn sessions). ``session``/``tenant`` are optional labels.
    """

    index: int
    arrival_s: float
    input_len: int
    output_len: int
    chunks: tuple[int, ...]
    session: str | None = None
    tenant: str | None = None
    follows: int | None = None
    think_s: float = 0.0


@dataclass(slots=True)
class Trace:
    """An ordered list of requests (by arrival; ``follows`` requests keep their generator order)."""

    name: str
    requests: list[TraceRequest]
    meta: dict[str, float | int | str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def duration_s(self) -> float:
        """Last open-loop arrival minus the first (0 for fewer than two requests)."""
        ts = [r.arrival_s for r in self.requests if r.follows is None]
        return (max(ts) - min(ts)) if len(ts) > 1 else 0.0

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (follow-ups of dropped requests are dropped too)."""
        keep = [r for r in self.requests[:n] if r.follows is None or r.follows < n]
        return Trace(f"{self.name}[:{n}]", keep, dict(self.meta))

    def window(self, t0: float, t1: float) -> Trace:
        """Open-loop requests arriving in [t0, t1), re-indexed from 0 and shifted to start at 0."""
        sel = [r for r in self.requests if r.follows is None and t0 <= r.arrival_s < t1]
        reqs = [replace(r, index=i, arrival_s=r.arrival_s - t0) for i, r in enumerate(sel)]
        return Trace(f"{self.name}[{t0:g}s:{t1:g}s]", reqs, dict(self.meta))


def splitmix64(x: np.ndarray) -> np.ndarray:
    """Vectorised SplitMix64 finaliser over uint64 (wrapping arithmetic)."""
    z = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z = (z + np.uint64(0x9E3779B97F4A7C15)) & _M64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        z = z ^ (z >> np.uint64(31))
    return z


def chunk_tokens(chunk_ids: Sequence[int], vocab_size: int = DEFAULT_VOCAB) -> np.ndarray:
    """Token ids (int64) of the given chunks, 512 per chunk, concatenated in order."""
    ids = np.asarray(chunk_ids, dtype=np.uint64)
    base = (ids[:, None] * np.uint64(CHUNK_TOKENS)) + np.arange(1, CHUNK_TOKENS + 1, dtype=np.uint64)[None, :]
    return (splitmix64(base.ravel()) % np.uint64(vocab_size)).astype(np.int64)


def prompt_tokens(req: TraceRequest, vocab_size: int = DEFAULT_VOCAB) -> np.ndarray:
    """The request's prompt token ids: its chunks expanded and cut to ``input_len``."""
    need = -(-req.input_len // CHUNK_TOKENS)
    if need > len(req.chunks):
        raise ValueError(f"request {req.index}: {len(req.chunks)} chunks < ceil({req.input_len}/512)")
    return chunk_tokens(req.chunks[:need], vocab_size)[: req.input_len]


class ChunkIds:
    """Allocator of fresh chunk ids in a namespace disjoint from the Mooncake ids (< 2^32).

    Ids stay below 2^54, so ``c · 512`` never wraps in uint64.
    """

    def __init__(self, namespace: int) -> None:
        if not 1 <= namespace < 2**18:
            raise ValueError("namespace must be in [1, 2^18)")
        self._next = namespace << 36

    def take(self, n: int) -> tuple[int, ...]:
        """``n`` ids never handed out before by this allocator."""
        out = tuple(range(self._next, self._next + n))
        self._next += n
        return out


def spread_simultaneous(trace: Trace) -> Trace:
    """Undo timestamp quantisation: the k open-loop requests sharing a timestamp t are spread evenly over
    [t, t_next), the j-th (in file order) at ``t + j·(t_next − t)/k``; the last group keeps the median gap.
    Deterministic; the order of requests and everything but ``arrival_s`` are unchanged."""
    stamps = sorted({r.arrival_s for r in trace if r.follows is None})
    if len(stamps) < 2:
        return trace
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    nxt = dict(zip(stamps, [*stamps[1:], stamps[-1] + sorted(gaps)[len(gaps) // 2]], strict=True))
    groups: dict[float, list[int]] = {}
    for i, r in enumerate(trace.requests):
        if r.follows is None:
            groups.setdefault(r.arrival_s, []).append(i)
    reqs = list(trace.requests)
    for t, idx in groups.items():
        k = len(idx)
        for j, i in enumerate(idx):
            reqs[i] = replace(reqs[i], arrival_s=t + j * (nxt[t] - t) / k)
    return Trace(f"{trace.name}+spread", reqs, {**trace.meta, "spread": 1})
