"""Synthetic workloads (deterministic under ``seed``), built from 512-token chunks like the real traces.

* :func:`shared_prefix_tenants` — many tenants, each with a long system prompt shared by all its requests;
  tenant popularity is Zipf(``zipf_s``): P(tenant k) ∝ 1/k^s.
* :func:`multi_turn_sessions` — conversations: a session is one token stream (fresh chunk ids); turn k's
  prompt is the stream's first ``L_k`` tokens (previous prompt + previous answer + new user text), sent
  ``think_s`` after turn k−1 completes (closed loop, ``follows``).
* :func:`bursty` — Poisson arrivals whose rate is ``burst_factor`` × the base rate inside periodic windows.
* :func:`long_context_mix` — chat traffic with a fraction of 100K-token prompts (long-context penetration).
* :func:`concurrent_long` — ``clients`` closed-loop clients sending long prompts over shared documents
  back to back (the "32 concurrent long requests" setting of DESIGN.md §1).
* :func:`poisson_conversations` — open-loop (Poisson) arrivals of chat turns over tenant system prompts and
  growing conversations, with longer prompts than the development trace; it has only what a Mooncake trace
  holds (arrival, lengths, 512-token chunk ids), so ``readers.write_mooncake`` writes it as one
  (``python -m kvmesh.fleet.gen_trace``).
"""

from __future__ import annotations

import numpy as np

from kvmesh.fleet.trace import CHUNK_TOKENS, ChunkIds, Trace, TraceRequest


def _chunks_for(n_tokens: int) -> int:
    return -(-n_tokens // CHUNK_TOKENS)


def poisson_arrivals(rate: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times of a homogeneous Poisson process of ``rate``/s on [0, duration_s)."""
    n = int(rng.poisson(rate * duration_s))
    return np.sort(rng.uniform(0.0, duration_s, size=n))


def bursty_arrivals(
    rate: float,
    duration_s: float,
    rng: np.random.Generator,
    burst_factor: float = 10.0,
    period_s: float = 120.0,
    burst_s: float = 10.0,
) -> np.ndarray:
    """Poisson arrivals at ``rate``, ``burst_factor``·rate during [k·period, k·period + burst_s)."""
    base = poisson_arrivals(rate, duration_s, rng)
    extra: list[np.ndarray] = []
    for start in (float(x) for x in np.arange(0.0, duration_s, period_s)):
        span = min(burst_s, duration_s - start)
        n = int(rng.poisson(rate * (burst_factor - 1.0) * span))
        extra.append(rng.uniform(start, start + span, size=n))
    return np.sort(np.concatenate([base, *extra])) if extra else base


def shared_prefix_tenants(
    seed: int = 0,
    n_tenants: int = 32,
    sys_tokens: int = 8192,
    user_tokens: tuple[int, int] = (256, 2048),
    output_tokens: tuple[int, int] = (64, 512),
    rate: float = 4.0,
    duration_s: float = 600.0,
    zipf_s: float = 1.1,
    arrivals: np.ndarray | None = None,
) -> Trace:
    """Requests = tenant system prompt (``sys_tokens``, a multiple of 512) + unique user text."""
    rng = np.random.default_rng(seed)
    alloc = ChunkIds(2)
    sys_chunks = [alloc.take(_chunks_for(sys_tokens)) for _ in range(n_tenants)]
    weights = 1.0 / np.arange(1, n_tenants + 1) ** zipf_s
    weights /= weights.sum()
    ts = poisson_arrivals(rate, duration_s, rng) if arrivals is None else arrivals
    reqs = []
    for i, t in enumerate(ts):
        k = int(rng.choice(n_tenants, p=weights))
        n_user = int(rng.integers(user_tokens[0], user_tokens[1] + 1))
        n_in = len(sys_chunks[k]) * CHUNK_TOKENS + n_user
        chunks = sys_chunks[k] + alloc.take(_chunks_for(n_user))
        n_out = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
        reqs.append(TraceRequest(i, float(t), n_in, n_out, chunks, tenant=f"t{k}"))
    return Trace("shared_prefix_tenants", reqs, {"tenants": n_tenants, "sys_tokens": sys_tokens})


def bursty(seed: int = 0, rate: float = 3.0, duration_s: float = 600.0, burst_factor: float = 10.0) -> Trace:
    """:func:`shared_prefix_tenants` content under :func:`bursty_arrivals` (10× bursts by default)."""
    rng = np.random.default_rng(seed + 1)
    ts = bursty_arrivals(rate, duration_s, rng, burst_factor=burst_factor)
    tr = shared_prefix_tenants(seed=seed, arrivals=ts)
    tr.name = "bursty"
    tr.meta["burst_factor"] = burst_factor
    return tr


def multi_turn_sessions(
    seed: int = 0,
    n_sessions: int = 200,
    turns: tuple[int, int] = (2, 8),
    first_tokens: tuple[int, int] = (1024, 8192),
    user_tokens: tuple[int, int] = (64, 1024),
    output_tokens: tuple[int, int] = (64, 512),
    session_rate: float = 0.5,
    think_s: tuple[float, float] = (2.0, 30.0),
) -> Trace:
    """Multi-turn conversations; each session's prompts are growing prefixes of one token stream."""
    rng = np.random.default_rng(seed)
    alloc = ChunkIds(3)
    starts = np.cumsum(rng.exponential(1.0 / session_rate, size=n_sessions))
    reqs: list[TraceRequest] = []
    for s, t0 in enumerate(starts):
        n_turns = int(rng.integers(turns[0], turns[1] + 1))
        length = int(rng.integers(first_tokens[0], first_tokens[1] + 1))
        outs = [int(rng.integers(output_tokens[0], output_tokens[1] + 1)) for _ in range(n_turns)]
        users = [int(rng.integers(user_tokens[0], user_tokens[1] + 1)) for _ in range(n_turns)]
        total = length + sum(outs) + sum(users)
        stream = alloc.take(_chunks_for(total))
        prev: int | None = None
        for k in range(n_turns):
            if k > 0:
                length += outs[k - 1] + users[k]
            idx = len(reqs)
            think = float(rng.uniform(*think_s))
            reqs.append(
                TraceRequest(
                    idx,
                    float(t0),
                    length,
                    outs[k],
                    stream[: _chunks_for(length)],
                    session=f"s{s}",
                    follows=prev,
                    think_s=think if prev is not None else 0.0,
                )
            )
            prev = idx
    return Trace("multi_turn_sessions", reqs, {"sessions": n_sessions})


def long_context_mix(
    seed: int = 0,
    rate: float = 4.0,
    duration_s: float = 600.0,
    long_fraction: float = 0.03,
    long_tokens: int = 100_000,
) -> Trace:
    """Shared-prefix chat traffic where ``long_fraction`` of requests carry a ``long_tokens`` prompt."""
    tr = shared_prefix_tenants(seed=seed, rate=rate, duration_s=duration_s)
    rng = np.random.default_rng(seed + 7)
    alloc = ChunkIds(4)
    reqs = []
    for r in tr.requests:
        if rng.random() < long_fraction:
            r = TraceRequest(r.index, r.arrival_s, long_tokens, r.output_len, alloc.take(_chunks_for(long_tokens)))
        reqs.append(r)
    return Trace("long_context_mix", reqs, {"long_fraction": long_fraction, "long_tokens": long_tokens})


def concurrent_long(
    seed: int = 0,
    clients: int = 32,
    per_client: int = 6,
    n_docs: int = 16,
    doc_tokens: tuple[int, int] = (16_384, 98_304),
    question_tokens: tuple[int, int] = (128, 1024),
    output_tokens: tuple[int, int] = (128, 1024),
) -> Trace:
    """``clients`` closed-loop clients, each asking ``per_client`` questions over shared long documents."""
    rng = np.random.default_rng(seed)
    alloc = ChunkIds(5)
    docs = [
        alloc.take(_chunks_for(int(rng.integers(*doc_tokens)) // CHUNK_TOKENS * CHUNK_TOKENS)) for _ in range(n_docs)
    ]
    reqs: list[TraceRequest] = []
    for c in range(clients):
        prev: int | None = None
        for _ in range(per_client):
            doc = docs[int(rng.integers(n_docs))]
            n_q = int(rng.integers(*question_tokens))
            n_in = len(doc) * CHUNK_TOKENS + n_q
            idx = len(reqs)
            reqs.append(
                TraceRequest(
                    idx,
                    0.0,
                    n_in,
                    int(rng.integers(*output_tokens)),
                    doc + alloc.take(_chunks_for(n_q)),
                    session=f"c{c}",
                    follows=prev,
                    think_s=0.0 if prev is None else float(rng.uniform(0.0, 1.0)),
                )
            )
            prev = idx
    return Trace("concurrent_long", reqs, {"clients": clients})


def poisson_conversations(
    seed: int = 0,
    rate: float = 2.0,
    duration_s: float = 1500.0,
    n_tenants: int = 24,
    zipf_s: float = 1.0,
    sys_tokens: tuple[int, int] = (2048, 12288),
    first_tokens: tuple[int, int] = (2048, 16384),
    user_tokens: tuple[int, int] = (256, 4096),
    output_tokens: tuple[int, int] = (32, 768),
    follow_p: float = 0.6,
    live: int = 200,
    max_prompt: int = 100_000,
) -> Trace:
    """Poisson(``rate``) arrivals on [0, ``duration_s``); each request is a turn of a conversation.

    With probability ``follow_p`` a turn continues one of the ``live`` most recently started conversations
    (uniformly): its prompt is the previous prompt + the previous answer + new user text (``user_tokens``);
    otherwise (or when that would pass ``max_prompt``) it starts a new one: a tenant's system prompt (tenant
    k with P ∝ 1/k^``zipf_s``, its length a multiple of 512 drawn from ``sys_tokens``) + ``first_tokens`` of
    user text. A conversation is one chunk stream, so turns share its chunk ids; arrivals are open-loop (no
    ``follows``), as in a Mooncake trace.
    """
    rng = np.random.default_rng(seed)
    alloc = ChunkIds(6)
    sys_chunks = [
        alloc.take(int(rng.integers(sys_tokens[0], sys_tokens[1] + 1)) // CHUNK_TOKENS) for _ in range(n_tenants)
    ]
    weights = 1.0 / np.arange(1, n_tenants + 1) ** zipf_s
    weights /= weights.sum()
    convs: list[tuple[list[int], int, int]] = []  # (chunk stream, prompt tokens, answer tokens) per conversation
    reqs: list[TraceRequest] = []
    for i, t in enumerate(poisson_arrivals(rate, duration_s, rng)):
        k = -1
        if convs and rng.random() < follow_p:
            k = len(convs) - 1 - int(rng.integers(min(live, len(convs))))
            stream, n_prev, n_ans = convs[k]
            n_in = n_prev + n_ans + int(rng.integers(user_tokens[0], user_tokens[1] + 1))
            k = k if n_in <= max_prompt else -1
        if k < 0:
            sys_c = sys_chunks[int(rng.choice(n_tenants, p=weights))]
            stream = list(sys_c)
            n_in = len(sys_c) * CHUNK_TOKENS + int(rng.integers(first_tokens[0], first_tokens[1] + 1))
            convs.append((stream, 0, 0))
            k = len(convs) - 1
        stream.extend(alloc.take(max(0, _chunks_for(n_in) - len(stream))))
        n_out = int(rng.integers(output_tokens[0], output_tokens[1] + 1))
        convs[k] = (stream, n_in, n_out)
        reqs.append(TraceRequest(i, float(t), n_in, n_out, tuple(stream[: _chunks_for(n_in)])))
    meta: dict[str, float | int | str] = {"rate": rate, "duration_s": duration_s, "seed": seed}
    return Trace("poisson_conversations", reqs, meta)
