"""Trace readers on the real files in shared/traces, token expansion and the synthetic generators."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvmesh.fleet.readers import read_azure, read_mooncake, read_trace, write_mooncake
from kvmesh.fleet.synthetic import (
    bursty,
    concurrent_long,
    long_context_mix,
    multi_turn_sessions,
    poisson_conversations,
    shared_prefix_tenants,
)
from kvmesh.fleet.trace import CHUNK_TOKENS, TraceRequest, chunk_tokens, prompt_tokens

pytestmark = pytest.mark.unit

TRACES = Path(__file__).resolve().parents[4] / "shared" / "traces"
MOONCAKE = TRACES / "mooncake_conversation_trace.jsonl"
AZURE = TRACES / "AzureLLMInferenceTrace_conv.csv"


def test_mooncake_real_file_matches_readme_statistics() -> None:
    tr = read_mooncake(MOONCAKE)
    assert len(tr) == 12_031
    assert tr.duration_s == pytest.approx(3536.999)
    assert tr.requests[0].arrival_s == 0.0 and tr.requests[0].chunks[0] == 0
    assert all(len(r.chunks) == -(-r.input_len // CHUNK_TOKENS) for r in tr)
    assert all(r.chunks[0] == 0 for r in tr)
    ins = np.array([r.input_len for r in tr])
    assert ins.mean() == pytest.approx(12_035.1, abs=0.1)
    seen: set[int] = set()
    rep = total = 0
    for r in tr:
        total += len(r.chunks)
        rep += sum(1 for c in r.chunks if c in seen)
        seen.update(r.chunks)
    assert (total, len(seen)) == (288_500, 182_790)
    assert rep / total == pytest.approx(0.3664, abs=1e-4)


def test_azure_real_file_lengths_only_unique_chunks() -> None:
    tr = read_azure(AZURE)
    assert len(tr) == 19_366
    assert tr.duration_s == pytest.approx(3501.7, abs=0.1)
    assert np.mean([r.input_len for r in tr]) == pytest.approx(1154.7, abs=0.1)
    ids = [c for r in tr for c in r.chunks]
    assert len(ids) == len(set(ids))  # no prefix information → nothing shared
    assert read_trace(AZURE, limit=5).requests[4].index == 4


def test_token_expansion_is_a_function_of_the_chunk_id() -> None:
    a = chunk_tokens([7, 8])
    b = chunk_tokens([7, 9])
    assert a.shape == (1024,) and a.dtype == np.int64
    assert np.array_equal(a[:512], b[:512]) and not np.array_equal(a[512:], b[512:])
    assert a.min() >= 0 and a.max() < 128_256
    short = prompt_tokens(TraceRequest(0, 0.0, 700, 1, (7, 8)))
    assert np.array_equal(short, a[:700])  # the partial last chunk is its id's leading tokens
    with pytest.raises(ValueError):
        prompt_tokens(TraceRequest(0, 0.0, 1100, 1, (7, 8)))


@pytest.mark.parametrize("block_size", [16, 64, 512])
def test_equal_ids_give_equal_hashes_at_block_sizes_dividing_512(block_size: int) -> None:
    from kvmesh.index.hashing import compute_block_hashes

    tr = read_mooncake(MOONCAKE, limit=400)
    # find two requests sharing exactly k leading chunk ids, k >= 2
    first: tuple[TraceRequest, TraceRequest, int] | None = None
    for r in tr:
        for s in tr.requests[: r.index]:
            k = 0
            while k < min(len(r.chunks), len(s.chunks)) and r.chunks[k] == s.chunks[k]:
                k += 1
            if k >= 2 and min(r.input_len, s.input_len) >= 512 * (k + 1):  # block k full in both
                first = (s, r, k)
                break
        if first:
            break
    assert first is not None, "the trace has shared prefixes"
    a, b, k = first
    ha = compute_block_hashes(prompt_tokens(a), block_size)
    hb = compute_block_hashes(prompt_tokens(b), block_size)
    shared = k * 512 // block_size
    assert np.array_equal(ha[:shared], hb[:shared])
    assert ha[shared] != hb[shared]


def test_synthetic_generators_are_deterministic_and_shaped() -> None:
    t1, t2 = shared_prefix_tenants(seed=3, duration_s=60), shared_prefix_tenants(seed=3, duration_s=60)
    assert t1.requests == t2.requests and len(t1) > 100
    assert all(r.chunks[:16] == t1.requests[0].chunks[:16] for r in t1 if r.tenant == t1.requests[0].tenant)
    assert shared_prefix_tenants(seed=4, duration_s=60).requests != t1.requests

    b = bursty(seed=0, rate=2.0, duration_s=240)
    ts = np.array([r.arrival_s for r in b])
    in_burst = ((ts % 120.0) < 10.0).sum() / 20.0  # rate inside bursts (2 windows × 10 s)
    out_burst = ((ts % 120.0) >= 10.0).sum() / 220.0
    assert 5.0 < in_burst / out_burst < 16.0

    mt = multi_turn_sessions(seed=0, n_sessions=20)
    for r in mt:
        if r.follows is not None:
            p = mt.requests[r.follows]
            assert p.session == r.session and r.input_len > p.input_len
            assert r.chunks[: len(p.chunks) - 1] == p.chunks[:-1]

    lc = long_context_mix(seed=0, duration_s=300, long_fraction=0.05)
    longs = [r for r in lc if r.input_len == 100_000]
    assert 0.02 < len(longs) / len(lc) < 0.09

    cl = concurrent_long(clients=32, per_client=3)
    assert sum(1 for r in cl if r.follows is None) == 32 and len(cl) == 96


def test_spread_simultaneous_undoes_quantised_timestamps() -> None:
    from kvmesh.fleet.trace import spread_simultaneous

    tr = read_mooncake(MOONCAKE, limit=300)
    sp = spread_simultaneous(tr)
    assert len({r.arrival_s for r in tr}) < len(tr) // 5  # the trace batches ~10 requests per timestamp
    assert len({r.arrival_s for r in sp}) == len(sp)
    ts = [r.arrival_s for r in sp]
    assert ts == sorted(ts)
    for a, b in zip(tr, sp, strict=True):
        assert a.arrival_s <= b.arrival_s < a.arrival_s + 3.1 and a.chunks == b.chunks


def test_poisson_conversations_round_trip_through_the_mooncake_format(tmp_path: Path) -> None:
    tr = poisson_conversations(seed=1, rate=2.0, duration_s=300.0)
    assert tr.requests == poisson_conversations(seed=1, rate=2.0, duration_s=300.0).requests
    assert tr.requests != poisson_conversations(seed=2, rate=2.0, duration_s=300.0).requests
    assert 450 < len(tr) < 750  # Poisson(600)
    gaps = np.diff([r.arrival_s for r in tr])
    assert 0.7 < gaps.std() / gaps.mean() < 1.3  # exponential gaps: coefficient of variation 1
    lens = np.array([r.input_len for r in tr])
    assert np.median(lens) > 12_000 and lens.max() <= 100_000  # longer than the development trace (p50 6.9K)
    turns = sum(1 for a in tr for b in tr.requests[: a.index] if b.chunks == a.chunks[: len(b.chunks)])
    assert turns > len(tr) // 4  # continued conversations: an earlier prompt is a chunk prefix of a later one
    path = tmp_path / "t.jsonl"
    assert write_mooncake(tr, path) == len(tr)
    back = read_mooncake(path)
    assert [(r.input_len, r.output_len) for r in back] == [(r.input_len, r.output_len) for r in tr]
    assert [r.arrival_s for r in back] == [round(r.arrival_s * 1000) / 1000 for r in tr]

    def shared(x: TraceRequest, y: TraceRequest) -> int:  # leading chunks two prompts share
        return next(
            (k for k, (u, v) in enumerate(zip(x.chunks, y.chunks, strict=False)) if u != v),
            min(len(x.chunks), len(y.chunks)),
        )

    pairs = [(i, j) for i in range(60) for j in range(i)]
    got = [shared(back.requests[i], back.requests[j]) for i, j in pairs]
    assert got == [shared(tr.requests[i], tr.requests[j]) for i, j in pairs] and max(got) > 8  # ids renumbered
    assert min(c for r in back for c in r.chunks) == 0


def test_write_mooncake_refuses_closed_loop_requests(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="open-loop"):
        write_mooncake(multi_turn_sessions(seed=0, n_sessions=3), tmp_path / "x.jsonl")
