"""Copies between vLLM's paged KV cache tensors and one contiguous block buffer (torch, no vLLM).

A block's bytes are the concatenation over `PagedKv.layers` (attention layers in name order, a tensor
shared by several layers taken once) of `kv_cache[block_id]`: one copy out of the cache when saving, one
copy in when loading.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


class PagedKv:
    """The engine's per-layer KV cache tensors, block-major (`[num_blocks, ...]` per layer)."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        seen: set[int] = set()
        self.layers: list[torch.Tensor] = []
        for name in sorted(kv_caches):
            t = kv_caches[name]
            if t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            self.layers.append(t)
        if not self.layers:
            raise ValueError("no KV cache tensors")
        self.layer_bytes = [t[0].numel() * t.element_size() for t in self.layers]
        self.block_bytes = sum(self.layer_bytes)
        self.num_blocks = min(int(t.shape[0]) for t in self.layers)
        self.dtype = str(self.layers[0].dtype)

    def gather(self, block_id: int, out: torch.Tensor) -> None:
        """Copies block `block_id` of every layer into `out` (uint8, `block_bytes` long)."""
        off = 0
        for t, n in zip(self.layers, self.layer_bytes, strict=True):
            out[off : off + n].view(t.dtype).view(t[block_id].shape).copy_(t[block_id])
            off += n

    def scatter(self, block_id: int, src: torch.Tensor) -> None:
        """Copies `src` (uint8, `block_bytes` long) into block `block_id` of every layer."""
        off = 0
        for t, n in zip(self.layers, self.layer_bytes, strict=True):
            t[block_id].copy_(src[off : off + n].view(t.dtype).view(t[block_id].shape))
            off += n


def byte_tensor(buf: bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over `buf`'s memory (no copy)."""
    return torch.frombuffer(buf, dtype=torch.uint8)
