"""What a vLLM KV block is, byte for byte, and its collision-resistant identity (pure: no vLLM, no torch).

A block of `block_size` tokens is stored in a tier slot as the concatenation, over the attention layers in
name order, of that layer's block in one fixed format, whatever vLLM's own arrangement in memory is: for each
KV head (`num_kv_heads`, this tensor-parallel rank's shard), for each of the block's tokens, the token's K
(`head_size` elements) then its V (`head_size_v`), i.e. `[heads, tokens, K|V]` per layer (`BLOCK_FORMAT`,
vLLM's `LBHNC` arrangement with the block's bytes contiguous; what vLLM's CPU backend keeps in memory).
`blocks.PagedKv` reads vLLM's real arrangement (any of vLLM's `KVCacheLayout`s, split kernel blocks, K and V
planes, an MLA latent cache) from the registered tensors and copies between it and this format, so engines
whose attention backends arrange their caches differently still exchange blocks. An MLA model's block is
its latent cache (`head_size` = kv_lora_rank + rope dim, one "head", `head_size_v` = 0: no V).

The format is read from the model config alone (`layout_from_vllm`): the front end (which computes a
prompt's digests for pulls) and every engine process agree on it without knowing which backend the engine
core picked. Two engines exchange a block only if their `KvLayout.describe()` strings are equal (a tier
region carries it; a reader of another layout is refused), and the layout without the tensor-parallel rank
(`identity()`) is part of the block identity's salt (DESIGN.md §3: tokens, model, LoRA adapter, tenant salt,
dtype, block size, layout), so a block computed under another layout, adapter or tenant can never be found
under the same digest, while every rank names its shard of a block as the scheduler does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.index.hashing import sha256_block_ids

BLOCK_FORMAT = "LBHNC"  # per layer [kv heads, tokens, K|V]: see the module docstring


@dataclass(frozen=True)
class KvLayout:
    """The shape of one engine's KV blocks (one tensor-parallel rank's shard), as far as moving blocks between
    engines is concerned."""

    model: str
    dtype: str  # the KV cache's element type, e.g. "torch.bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int  # this rank's KV heads (1 for an MLA latent cache)
    head_size: int  # K's size per head (an MLA latent cache: kv_lora_rank + rope dim)
    kind: str = BLOCK_FORMAT  # the block format (not vLLM's arrangement in memory, which PagedKv converts)
    tp_rank: int = 0
    tp_size: int = 1
    head_size_v: int | None = None  # V's size per head: None = head_size; 0 = an MLA latent cache (no V)

    @property
    def value_size(self) -> int:
        return self.head_size if self.head_size_v is None else self.head_size_v

    @property
    def token_size(self) -> int:
        """Elements per (head, token): K then V."""
        return self.head_size + self.value_size

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (K and V)."""
        itemsize = dtype_itemsize(self.dtype)
        return self.num_layers * self.num_kv_heads * self.block_size * self.token_size * itemsize

    def describe(self) -> str:
        """The layout string a tier region carries (<= 256 bytes; equal strings = exchangeable blocks)."""
        return self._text(str(self.tp_rank))

    def identity(self) -> str:
        """`describe()` without the tensor-parallel rank: the block identity's salt. The scheduler names a block
        once; each rank keeps its own shard of it under that name in its own region (`shard_region_name`),
        whose `describe()` (with the rank) keeps shards of different ranks apart."""
        return self._text("*")

    def _text(self, rank: str) -> str:
        value = "" if self.head_size_v is None or self.head_size_v == self.head_size else f";Dv={self.head_size_v}"
        return (
            f"{self.kind};bs={self.block_size};dt={self.dtype};L={self.num_layers};H={self.num_kv_heads};"
            f"D={self.head_size}{value};tp={rank}/{self.tp_size};"
            f"m={hashlib.sha256(self.model.encode()).hexdigest()[:16]}"
        )


def shard_region_name(shm_name: str, layout: KvLayout) -> str:
    """The tier region of this rank's shard: `shm_name` itself without tensor parallelism, else one region per
    rank (`<shm_name>-tp<rank>`); a peer's rank r region is found the same way from the peer's name."""
    return shm_name if layout.tp_size == 1 else f"{shm_name}-tp{layout.tp_rank}"


def layout_from_vllm(vllm_config: Any) -> KvLayout:
    """The layout of this engine's blocks from vLLM's config (model, parallel and cache configs): the same in
    the front end, the scheduler and every worker rank (`parallel_config.rank` is the worker's rank; the
    front end and the scheduler are rank 0). Reads attributes only: no vLLM import."""
    mc, pc, cc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.cache_config
    dtype = str(mc.dtype) if cc.cache_dtype == "auto" else f"torch.{cc.cache_dtype}"
    if dtype.startswith("torch.fp8"):
        dtype = "torch.uint8"
    tp_size = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    mla = bool(getattr(mc, "use_mla", False))
    return KvLayout(
        model=str(mc.model),
        dtype=dtype,
        block_size=int(cc.block_size),
        num_layers=int(mc.get_num_layers(pc)),
        num_kv_heads=int(mc.get_num_kv_heads(pc)),  # vLLM: 1 under MLA; total // tp (at least 1) otherwise
        head_size=int(mc.get_head_size()),
        tp_rank=int(getattr(pc, "rank", 0) or 0) % tp_size,
        tp_size=tp_size,
        head_size_v=0 if mla else None,
    )


def with_rank(layout: KvLayout, tp_rank: int) -> KvLayout:
    """`layout` as rank `tp_rank` of its tensor-parallel group holds it."""
    if not 0 <= tp_rank < layout.tp_size:
        raise ValueError(f"tp_rank {tp_rank} is outside 0..{layout.tp_size - 1}")
    return dataclasses.replace(layout, tp_rank=tp_rank)


_ITEMSIZE = {
    "torch.float32": 4,
    "torch.float16": 2,
    "torch.bfloat16": 2,
    "torch.float8_e4m3fn": 1,
    "torch.float8_e5m2": 1,
    "torch.uint8": 1,
}


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype named as `str(torch.dtype)`."""
    size = _ITEMSIZE.get(dtype)
    if size is None:
        raise ValueError(f"unsupported KV cache dtype {dtype!r}")
    return size


def block_salt(layout: KvLayout, lora: str | None, cache_salt: str | None) -> bytes:
    """The salt of a request's block identities: the layout (model, dtype, block size, shape; not the rank),
    the LoRA adapter and the tenant's cache salt, length-delimited by JSON so no two tuples share a salt."""
    text = json.dumps([layout.model, layout.identity(), lora or "", cache_salt or ""], separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()


def block_digests(
    token_ids: Sequence[int], layout: KvLayout, lora: str | None = None, cache_salt: str | None = None
) -> list[bytes]:
    """The identity of every full block of `token_ids` (chained SHA-256, `kvmesh.index.hashing.sha256_block_ids`)."""
    return sha256_block_ids(token_ids, layout.block_size, block_salt(layout, lora, cache_salt))
