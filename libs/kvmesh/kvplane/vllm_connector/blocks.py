"""Copies between vLLM's paged KV cache tensors and one contiguous block buffer (torch, no vLLM).

A block's bytes are the concatenation over `PagedKv.layers` (attention layers in name order, a tensor
shared by several layers taken once) of the layer's block in `layout.BLOCK_FORMAT` (`[heads, tokens, K|V]`),
whatever vLLM's arrangement in memory. `PagedKv` reads that arrangement from each registered tensor's shape
and strides (`cache_view`):

- `[blocks, heads, tokens, K|V]`, any strides: vLLM's per-layer view under every `KVCacheLayout`
  (LBHNC, LBNHC, LHBNC, BLHNC, BLNHC, BHLNC; vLLM gives the logical order, the strides say where each
  element is: a block need not be contiguous, e.g. LHBNC keeps each head's tokens of all blocks together);
  an MLA latent cache is the case heads = 1, no V.
- `[2, blocks, tokens, heads, head_size]`: K and V planes (FlashAttention's cache shape in vLLM releases
  before the `KVCacheLayout` descriptor); both planes of a block are copied.
- `[blocks, tokens, latent]`: an MLA latent cache without the head axis.
- kernel blocks: when the attention kernel pages by fewer tokens than vLLM's block (the tensor has
  `block_size / tokens` times as many blocks), logical block b is kernel blocks `kernel_block_ids(b)`,
  all copied, tokens in order.

Anything else (a hybrid model's state tensors, a packed or quantized cell) is refused (`UnsupportedLayout`,
one line naming the tensor and its shape). Each layer is one `copy_` per block (torch does the strided
gather/scatter, on the tensors' device). `HostStaging` moves blocks between device tensors and pinned host
memory asynchronously, on a copy stream, for a connector that overlaps copies with the forward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvmesh.kvplane.vllm_connector.layout import KvLayout, dtype_itemsize


class UnsupportedLayout(ValueError):
    """The registered KV cache tensors are not in an arrangement `PagedKv` can copy blocks of."""


@dataclass(frozen=True)
class LayerView:
    """One layer's cache as `[logical blocks, heads, (kernel blocks,) tokens, K|V cell...]` (a view, no copy):
    `view[b]` is logical block b, in the block format's element order once made contiguous."""

    view: torch.Tensor
    arrangement: str  # what was found, for logs: e.g. "BHNC strides BNHC", "2BNHD ...", "kernel blocks ..."
    kernel_blocks: int = 1  # the attention kernel's blocks per logical block


def _order(t: torch.Tensor, names: str) -> str:
    """The axes of `t` from the outermost in memory to the innermost (by stride), e.g. "BNHC"."""
    return "".join(names[i] for i in sorted(range(t.dim()), key=lambda i: -t.stride()[i]))


def _shape(t: torch.Tensor) -> str:
    return f"shape {list(t.shape)} strides {list(t.stride())} {t.dtype}"


def cache_view(name: str, t: torch.Tensor, layout: KvLayout) -> LayerView:
    """`t` (a layer's registered KV cache) as logical blocks in the block format; UnsupportedLayout if its
    shape is none `PagedKv` knows for `layout` (the message names the tensor, its shape and what was
    expected)."""
    heads, bs, k, v = layout.num_kv_heads, layout.block_size, layout.head_size, layout.value_size
    expect = (
        f"expected [blocks, {heads} heads, tokens dividing {bs}, {k}+{v}]"
        + (f", [2, blocks, tokens, {heads} heads, {k}]" if k == v else "")
        + (f" or [blocks, tokens, {k}]" if heads == 1 and v == 0 else "")
    )

    def refuse(why: str) -> UnsupportedLayout:
        return UnsupportedLayout(f"KV cache tensor {name!r}: {_shape(t)} is not supported ({why}; {expect})")

    one_byte = t.element_size() == dtype_itemsize(layout.dtype) == 1  # fp8 caches: vLLM may view them as uint8
    if str(t.dtype) != layout.dtype and not one_byte:
        raise refuse(f"its elements are {t.dtype}, the layout's {layout.dtype}")
    if t.dim() == 4 and t.shape[1] == heads and t.shape[3] == k + v:
        view, arrangement = t, f"BHNC strides {_order(t, 'BHNC')}"
    elif t.dim() == 5 and t.shape[0] == 2 and t.shape[3] == heads and t.shape[4] == k == v:
        # K and V planes: block b is t[:, b] ([2, tokens, heads, D]); the format wants [heads, tokens, 2, D]
        view, arrangement = t.permute(1, 3, 2, 0, 4), f"2BNHD strides {_order(t, '2BNHD')}"
    elif t.dim() == 3 and heads == 1 and v == 0 and t.shape[2] == k:
        view, arrangement = t.unsqueeze(1), f"BNC strides {_order(t, 'BNC')}"
    else:
        raise refuse("unknown shape")
    tokens = int(view.shape[2])
    if tokens == 0 or bs % tokens != 0:
        raise refuse(f"{tokens} tokens per kernel block do not divide the block size {bs}")
    per_block = bs // tokens
    if per_block > 1:  # kernel blocks b*r .. b*r+r-1 are logical block b: [B, r, H, n, ...] -> [B, H, r, n, ...]
        if view.shape[0] % per_block != 0:
            raise refuse(f"{view.shape[0]} kernel blocks are not whole blocks of {per_block}")
        view = view.unflatten(0, (view.shape[0] // per_block, per_block)).transpose(1, 2)
        arrangement += f", kernel blocks of {tokens} tokens x{per_block}"
    return LayerView(view, arrangement, per_block)


class PagedKv:
    """The engine's per-layer KV cache tensors, as logical blocks in the block format.

    Without a layout (the CPU backend's `[num_blocks, heads, block_size, K|V]` contiguous tensors assumed),
    `t[block_id]` is a layer's block as it is in memory.
    """

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], layout: KvLayout | None = None) -> None:
        seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
        self.layers: list[torch.Tensor] = []  # each layer's view: [logical blocks, ...block cell]
        self.arrangements: list[str] = []
        self.kernel_blocks_per_block = 1
        for name in sorted(kv_caches):
            t = kv_caches[name]
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if key in seen:  # one tensor registered under several layers (vLLM's cross-layer KV sharing)
                continue
            seen.add(key)
            if layout is None:
                self.layers.append(t)
                self.arrangements.append("as registered")
                continue
            lv = cache_view(name, t, layout)
            self.layers.append(lv.view)
            self.arrangements.append(lv.arrangement)
            self.kernel_blocks_per_block = lv.kernel_blocks
        if not self.layers:
            raise UnsupportedLayout("no KV cache tensors")
        self.cell_shapes = [tuple(t.shape[1:]) for t in self.layers]
        self.layer_bytes = [t[0].numel() * t.element_size() for t in self.layers]
        self.block_bytes = sum(self.layer_bytes)
        self.num_blocks = min(int(t.shape[0]) for t in self.layers)
        self.dtype = str(self.layers[0].dtype)
        self.device = self.layers[0].device
        if layout is not None and self.block_bytes != layout.block_bytes:
            raise UnsupportedLayout(
                f"KV cache tensors hold {self.block_bytes} B per block over {len(self.layers)} layers "
                f"({self.arrangements[0]}), the layout {layout.describe()!r} says {layout.block_bytes} B"
            )

    def describe(self) -> str:
        """The arrangement found, for the log line that says the connector is on."""
        kinds = sorted(set(self.arrangements))
        return f"{len(self.layers)} layers on {self.device}, {'; '.join(kinds)}"

    def kernel_block_ids(self, block_id: int) -> range:
        """The attention kernel's blocks that make up vLLM block `block_id` (itself without splitting)."""
        r = self.kernel_blocks_per_block
        return range(block_id * r, (block_id + 1) * r)

    def _check(self, block_id: int, buf: torch.Tensor) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block_id {block_id} is outside 0..{self.num_blocks - 1}")
        if buf.dtype != torch.uint8 or buf.numel() < self.block_bytes:
            raise ValueError(f"block buffer: need {self.block_bytes} uint8, got {buf.numel()} {buf.dtype}")

    def _cells(self, buf: torch.Tensor) -> list[torch.Tensor]:
        out, off = [], 0
        for t, n, shape in zip(self.layers, self.layer_bytes, self.cell_shapes, strict=True):
            out.append(buf[off : off + n].view(t.dtype).view(shape))
            off += n
        return out

    def gather(self, block_id: int, out: torch.Tensor, non_blocking: bool = False) -> None:
        """Copies block `block_id` of every layer into `out` (uint8, `block_bytes` long; on any device)."""
        self._check(block_id, out)
        for t, cell in zip(self.layers, self._cells(out), strict=True):
            cell.copy_(t[block_id], non_blocking=non_blocking)

    def scatter(self, block_id: int, src: torch.Tensor, non_blocking: bool = False) -> None:
        """Copies `src` (uint8, `block_bytes` long; on any device) into block `block_id` of every layer."""
        self._check(block_id, src)
        for t, cell in zip(self.layers, self._cells(src), strict=True):
            t[block_id].copy_(cell, non_blocking=non_blocking)


def byte_tensor(buf: bytearray | memoryview) -> torch.Tensor:
    """A uint8 tensor over `buf`'s memory (no copy)."""
    return torch.frombuffer(buf, dtype=torch.uint8)


def host_memoryview(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 host tensor (pinned or not) as a writable memoryview (no copy): what
    the tier's `put` / `read_into` take."""
    if t.device.type != "cpu" or t.dtype != torch.uint8 or not t.is_contiguous():
        raise ValueError(f"need a contiguous uint8 host tensor, got {t.dtype} on {t.device}")
    return t.numpy().data.cast("B")


class CopyDone:
    """The end of an asynchronous batch of copies: `wait()` blocks the host until it ran, `wait_on(stream)`
    makes a device stream wait for it (no host sync), `done()` polls. On the CPU copies are synchronous:
    it is done when made."""

    def __init__(self, event: torch.cuda.Event | None = None, device: torch.device | None = None) -> None:
        self._event = event
        self._device = device

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def wait_on(self, stream: torch.cuda.Stream | None = None) -> None:
        """Makes `stream` (the current one when None) wait for the copies, e.g. before the forward reads
        loaded blocks."""
        if self._event is not None:
            (stream or torch.cuda.current_stream(self._device)).wait_event(self._event)


def pinned_available(device: torch.device) -> bool:
    """Whether host staging for `device` is page-locked: only for CUDA devices (pinning needs the driver)."""
    return device.type == "cuda" and torch.cuda.is_available()


class HostStaging:
    """`slots` block buffers in host memory for `kv`'s device: page-locked when the device is a GPU (so
    copies to and from it are asynchronous DMA), plain memory otherwise.

    `save(block_ids)` copies those blocks out of the cache into slots 0..n-1, `load(block_ids)` copies
    slots 0..n-1 into those blocks; both are queued on `stream` (a copy stream of its own by default, so they
    overlap the forward) with `non_blocking=True` and return a `CopyDone`. A save first waits (on the
    device) for the work queued on the current stream, so it copies what the forward wrote; a load's
    `CopyDone.wait_on()` makes the forward's stream wait for it. The slots must not be touched by the host
    (tier reads or writes) before the `CopyDone` of a save is done, nor refilled before that of a load is.
    """

    def __init__(self, kv: PagedKv, slots: int, stream: torch.cuda.Stream | None = None) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.kv = kv
        self.pinned = pinned_available(kv.device)
        self.buf = torch.empty((slots, kv.block_bytes), dtype=torch.uint8, pin_memory=self.pinned)
        self.stream = stream if stream is not None or kv.device.type != "cuda" else torch.cuda.Stream(kv.device)

    @property
    def slots(self) -> int:
        return int(self.buf.shape[0])

    def slot(self, i: int) -> torch.Tensor:
        """Slot `i` (uint8, `kv.block_bytes`)."""
        return self.buf[i]

    def slot_bytes(self, i: int) -> memoryview:
        """Slot `i` as bytes for the tier (`TierRegion.put`, `RegionReader.read_into`)."""
        return host_memoryview(self.buf[i])

    def _batch(self, block_ids: Sequence[int]) -> None:
        if len(block_ids) > self.slots:
            raise ValueError(f"{len(block_ids)} blocks do not fit {self.slots} staging slots")

    def save(self, block_ids: Sequence[int]) -> CopyDone:
        """Queues cache blocks `block_ids` -> slots 0..n-1."""
        self._batch(block_ids)
        if self.stream is None:
            for i, b in enumerate(block_ids):
                self.kv.gather(b, self.buf[i])
            return CopyDone()
        self.stream.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(self.stream):
            for i, b in enumerate(block_ids):
                self.kv.gather(b, self.buf[i], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return CopyDone(event, self.kv.device)

    def load(self, block_ids: Sequence[int]) -> CopyDone:
        """Queues slots 0..n-1 -> cache blocks `block_ids`."""
        self._batch(block_ids)
        if self.stream is None:
            for i, b in enumerate(block_ids):
                self.kv.scatter(b, self.buf[i])
            return CopyDone()
        self.stream.wait_stream(torch.cuda.current_stream(self.kv.device))  # a step still reading a reused block
        with torch.cuda.stream(self.stream):
            for i, b in enumerate(block_ids):
                self.kv.scatter(b, self.buf[i], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return CopyDone(event, self.kv.device)
