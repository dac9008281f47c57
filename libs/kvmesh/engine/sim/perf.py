"""Roofline performance model of one H200 serving a 70B FP8 model (pure; see docs/engine-model.md).

Every engine iteration is priced with the roofline rule

    t_step = max(bytes / (B_hbm · η_bw), flops / (F_fp8 · η_mfu)) + t_overhead

where, for a step that prefills chunks (n_i new tokens on top of c_i tokens already cached) and decodes
a batch of b sequences with contexts k_j:

    flops = 2·P·(Σ n_i + b)                                  (dense matmuls: 2 FLOPs per weight per token)
          + 4·L·H·d·(Σ n_i·(c_i + (n_i+1)/2) + Σ k_j)        (QKᵀ and A·V, causal: a token attends to
                                                              everything before it)
    bytes = W + KV_tok · (Σ (c_i + n_i) + Σ k_j)             (weights once per step; each cached K/V
                                                              read once, new K/V written once)

with P parameters, W weight bytes, L layers, H·d = query width, and the KV bytes per token
KV_tok = 2 · L · H_kv · d · bytes_per_elem (K and V). Decode with a small batch is memory-bound
(W / bandwidth ≈ 17 ms); prefill of more than a few hundred tokens is compute-bound.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.routing.dataplane import TransferFigures


@dataclass(frozen=True, slots=True)
class PerfModel:
    """Constants of the hardware + model pair. Defaults: H200 SXM + Llama-3.1-70B, FP8 weights and KV."""

    # Model shape (Llama-3.1-70B config.json).
    n_params: float = 70.6e9
    n_layers: int = 80
    n_heads: int = 64
    n_kv_heads: int = 8
    head_dim: int = 128
    weight_bytes_per_param: float = 1.0  # FP8 (E4M3) weights
    kv_bytes_per_elem: float = 1.0  # --kv-cache-dtype fp8
    # Hardware (NVIDIA H200 SXM datasheet).
    hbm_bytes: float = 141e9
    hbm_bandwidth: float = 4.8e12  # bytes/s
    peak_flops: float = 1979e12  # FP8 dense tensor-core FLOP/s (3958 with 2:4 sparsity)
    # Achieved fractions (see docs/engine-model.md for the calibration).
    bandwidth_efficiency: float = 0.85
    mfu: float = 0.5  # 0.5 · 1979 ≈ 989 TFLOP/s effective
    step_overhead_s: float = 0.0015  # scheduler, sampling, kernel launches per iteration
    # Memory budget (vLLM defaults).
    gpu_memory_utilization: float = 0.90
    activation_reserve_bytes: float = 6e9  # activations, CUDA graphs, workspace

    @property
    def weight_bytes(self) -> float:
        """W = P · bytes_per_param."""
        return self.n_params * self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """KV_tok = 2 (K,V) · L · H_kv · d · bytes_per_elem = 163 840 B for the default model."""
        return 2.0 * self.n_layers * self.n_kv_heads * self.head_dim * self.kv_bytes_per_elem

    @property
    def effective_bandwidth(self) -> float:
        """B_hbm · η_bw (bytes/s)."""
        return self.hbm_bandwidth * self.bandwidth_efficiency

    @property
    def effective_flops(self) -> float:
        """F_fp8 · η_mfu (FLOP/s)."""
        return self.peak_flops * self.mfu

    @property
    def attn_flops_per_pair(self) -> float:
        """4 · L · H · d: FLOPs of QKᵀ plus A·V for one (query token, key token) pair over all layers."""
        return 4.0 * self.n_layers * self.n_heads * self.head_dim

    def kv_cache_bytes(self) -> float:
        """KV budget = HBM · gpu_memory_utilization - W - activation reserve."""
        return self.hbm_bytes * self.gpu_memory_utilization - self.weight_bytes - self.activation_reserve_bytes

    def kv_capacity_blocks(self, block_size: int) -> int:
        """⌊KV budget / (KV_tok · block_size)⌋ KV blocks."""
        return max(1, int(self.kv_cache_bytes() // (self.kv_bytes_per_token * block_size)))


H200_LLAMA70B_FP8 = PerfModel()


def step_time(
    prefill_chunks: Sequence[tuple[int, int]],
    decode_contexts: Sequence[int],
    model: PerfModel = H200_LLAMA70B_FP8,
) -> float:
    """Seconds for one iteration: chunks are (new tokens n, cached context c); decodes are contexts k.

    Applies the roofline formula of the module docstring; an empty step costs 0.
    """
    if not prefill_chunks and not decode_contexts:
        return 0.0
    new_tokens = sum(n for n, _ in prefill_chunks) + len(decode_contexts)
    pairs = sum(n * (c + (n + 1) / 2.0) for n, c in prefill_chunks) + float(sum(decode_contexts))
    flops = 2.0 * model.n_params * new_tokens + model.attn_flops_per_pair * pairs
    kv_tokens = sum(c + n for n, c in prefill_chunks) + sum(decode_contexts)
    nbytes = model.weight_bytes + model.kv_bytes_per_token * kv_tokens
    return max(nbytes / model.effective_bandwidth, flops / model.effective_flops) + model.step_overhead_s


def prefill_time(tokens: int, context: int = 0, model: PerfModel = H200_LLAMA70B_FP8) -> float:
    """Seconds to prefill `tokens` new tokens on top of `context` cached ones, in one iteration."""
    if tokens <= 0:
        return 0.0
    return step_time([(tokens, context)], [], model)


def chunked_prefill_time(
    tokens: int, context: int = 0, chunk: int = 1024, model: PerfModel = H200_LLAMA70B_FP8
) -> float:
    """Seconds to prefill `tokens` in ⌈tokens/chunk⌉ iterations of ≤ `chunk` tokens, alone on the GPU."""
    total = 0.0
    done = 0
    for _ in range(math.ceil(max(tokens, 0) / chunk)):
        n = min(chunk, tokens - done)
        total += step_time([(n, context + done)], [], model)
        done += n
    return total


def kv_load_time(
    tokens: int, disk_tokens: int = 0, model: PerfModel = H200_LLAMA70B_FP8, links: LinkModel | None = None
) -> float:
    """Seconds to copy the KV of `tokens` tokens from host memory into the GPU, `disk_tokens` of them read
    from disk first: KV_tok·tokens / B_pcie + KV_tok·disk_tokens / B_disk (`LinkModel` figures)."""
    if tokens <= 0:
        return 0.0
    lk = links or H200_NODE_LINKS
    kv = model.kv_bytes_per_token
    return kv * tokens / lk.host_to_gpu_bytes_per_s + kv * max(0, disk_tokens) / lk.disk_bytes_per_s


def kv_pull_time(tokens: int, model: PerfModel = H200_LLAMA70B_FP8, links: LinkModel | None = None) -> float:
    """Seconds to pull the KV of `tokens` tokens from a peer: RTT + KV_tok·tokens / B_net (`LinkModel`)."""
    if tokens <= 0:
        return 0.0
    lk = links or H200_NODE_LINKS
    return lk.network_rtt_s + model.kv_bytes_per_token * tokens / lk.network_bytes_per_s


def decode_step_time(batch: int, total_context: int, model: PerfModel = H200_LLAMA70B_FP8) -> float:
    """Seconds for one decode iteration of `batch` sequences whose contexts sum to `total_context`.

    bytes = W + KV_tok·total_context; flops = 2·P·batch + 4·L·H·d·total_context (roofline as above).
    """
    if batch <= 0:
        return 0.0
    flops = 2.0 * model.n_params * batch + model.attn_flops_per_pair * total_context
    nbytes = model.weight_bytes + model.kv_bytes_per_token * total_context
    return max(nbytes / model.effective_bandwidth, flops / model.effective_flops) + model.step_overhead_s


@dataclass(frozen=True, slots=True)
class LinkModel:
    """Bandwidths and round trip of the links a KV block crosses on a real fleet (docs/engine-model.md).

    * ``host_to_gpu_bytes_per_s``: PCIe Gen5 x16 host→device copy of pinned memory on an H100/H200 node
      (64 GB/s raw per direction; 50–55 GB/s measured by ``bandwidthTest``): 50 GB/s.
    * ``network_bytes_per_s``: inter-node RDMA per GPU. The source deployment of the Mooncake trace (Kimi)
      runs 8×400 Gb/s RoCE per 8-GPU node; Mooncake's Transfer Engine measures 190 GB/s per node on it
      (kvcache-ai/Mooncake README), i.e. 190/8 = 23.75 GB/s per GPU (one NIC each).
    * ``network_rtt_s``: one request/lease round trip before the bytes flow (1 ms, conservative next to
      RDMA's microseconds: it covers the control RPC that grants the lease).
    * ``disk_bytes_per_s``: one NVMe SSD's sequential read (PCIe Gen4 SSDs: ~7 GB/s datasheet), 6 GB/s.
    """

    host_to_gpu_bytes_per_s: float = 50e9
    network_bytes_per_s: float = 190e9 / 8
    network_rtt_s: float = 1e-3
    disk_bytes_per_s: float = 6e9


H200_NODE_LINKS = LinkModel()


def transfer_figures(model: PerfModel = H200_LLAMA70B_FP8, links: LinkModel = H200_NODE_LINKS) -> TransferFigures:
    """The figures the routing data plane prices with, from this model: prefill 2·P / FLOP/s per token,
    KV_tok bytes per token, and the links' bandwidths and round trip."""
    return TransferFigures(
        prefill_s_per_token=2.0 * model.n_params / model.effective_flops,
        kv_bytes_per_token=model.kv_bytes_per_token,
        host_to_gpu_bytes_per_s=links.host_to_gpu_bytes_per_s,
        network_bytes_per_s=links.network_bytes_per_s,
        network_rtt_s=links.network_rtt_s,
    )


def block_bytes(block_size: int, model: PerfModel = H200_LLAMA70B_FP8) -> float:
    """Bytes of one KV block: KV_tok · block_size (83.9 MB at 512 tokens for the default model)."""
    return model.kv_bytes_per_token * block_size


def tier_blocks(gigabytes: float, block_size: int, model: PerfModel = H200_LLAMA70B_FP8) -> int:
    """KV blocks that ``gigabytes`` (10⁹ B) of tier memory hold: ⌊G·10⁹ / block_bytes⌋."""
    return max(0, int(gigabytes * 1e9 // block_bytes(block_size, model)))
