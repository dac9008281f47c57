"""`PagedKv` block copies on the caches vLLM's own allocator lays out under every `KVCacheLayout` (and split
into kernel blocks), FlashAttention's K/V planes and MLA latent caches; tensor-parallel shards; refusals of
arrangements it cannot copy; `HostStaging` on the CPU; the layout read from vLLM's config; and the device
check's self-test (`scripts/device_check.sh` on CPU tensors, with vLLM and the tier's checksum package made
unimportable, as on a GPU machine with a plain torch install)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvmesh.kvplane.vllm_connector.blocks import HostStaging, PagedKv, UnsupportedLayout
from kvmesh.kvplane.vllm_connector.device_check import (
    VLLM_LAYOUTS,
    Case,
    canon_blocks,
    check_staging,
    check_tier,
    vllm_layout_views,
)
from kvmesh.kvplane.vllm_connector.layout import (
    KvLayout,
    block_salt,
    layout_from_vllm,
    shard_region_name,
    with_rank,
)

ROOT = Path(__file__).resolve().parents[4]
CPU = torch.device("cpu")
LAYERS, BLOCKS, HEADS, TOKENS, D = 3, 6, 2, 32, 8
DT = torch.bfloat16
LAYOUT = KvLayout("m", str(DT), TOKENS, LAYERS, HEADS, D)


def vllm_views(name: str, kernel_tokens: int | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The layer views vLLM's own allocator makes (its stride computation and `create_kv_cache_views`)."""
    vkv = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[name]
    spec = vkv.FullAttentionSpec(block_size=TOKENS, num_kv_heads=HEADS, head_size=D, dtype=DT)
    block = spec.page_size_bytes * LAYERS if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = vkv.compute_layout_strides(
        spec, BLOCKS, LAYERS, layout, fixed_strides=(None, block, None, None, None)
    )
    size = spec.page_size_bytes * BLOCKS * LAYERS
    tensor = vkv.KVCacheTensor(size, [f"l{i}" for i in range(LAYERS)], layer_stride, block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    return raw, vkv.create_kv_cache_views(raw, spec, BLOCKS, layout, tensor, kernel_block_size=kernel_tokens)


SPLITS = [(name, kt) for name in VLLM_LAYOUTS for kt in (None, 16) if kt is None or name in ("LBHNC", "LBNHC")]


@pytest.mark.parametrize(("name", "kernel_tokens"), SPLITS)
def test_device_check_stand_in_lays_out_caches_as_vllm_does(name: str, kernel_tokens: int | None) -> None:
    raw, views = vllm_views(name, kernel_tokens)
    mine_raw, mine = vllm_layout_views(name, LAYERS, BLOCKS, HEADS, TOKENS, 2 * D, DT, CPU, kernel_tokens)
    assert mine_raw.numel() == raw.numel()
    for v, m in zip(views, mine, strict=True):
        assert (v.shape, v.stride(), v.storage_offset(), v.dtype) == (m.shape, m.stride(), m.storage_offset(), m.dtype)


@pytest.mark.parametrize(("name", "kernel_tokens"), SPLITS)
def test_gather_and_scatter_on_vllms_own_views(name: str, kernel_tokens: int | None) -> None:
    """Every block reads as `[heads, tokens, K|V]` per layer; a scatter writes that block's bytes and no other."""
    r = TOKENS // kernel_tokens if kernel_tokens else 1
    case = Case(LAYOUT, CPU, lambda dev: vllm_views(name, kernel_tokens), canon_blocks(r), seed=7)
    assert case.kv.kernel_blocks_per_block == r
    assert case.kv.num_blocks == BLOCKS and case.kv.block_bytes == LAYOUT.block_bytes
    case.check_copies(CPU)  # gathers vs the plain-indexing bytes; scatter vs the whole backing buffer
    out = torch.empty(LAYOUT.block_bytes, dtype=torch.uint8)
    for b in range(BLOCKS):
        case.kv.gather(b, out)
        assert torch.equal(out, case.canon(case.ref_views, b))


def test_a_block_is_the_same_bytes_whatever_the_arrangement() -> None:
    """Engines whose backends arrange the cache differently (or split blocks for their kernel) hold a block's
    content as the same bytes: the format is a property of the content, not of the engine."""
    content = torch.randn(LAYERS, BLOCKS, HEADS, TOKENS, 2 * D).to(DT)
    blocks: dict[tuple[str, int | None], list[torch.Tensor]] = {}
    for name, kt in SPLITS:
        _, views = vllm_views(name, kt)
        kv = PagedKv({f"l{i}": v for i, v in enumerate(views)}, LAYOUT)
        for i, t in enumerate(kv.layers):  # the logical block view: [B, H, (r, n | N), C]
            t.copy_(content[i].view(t.shape) if t.dim() == 4 else content[i].unflatten(2, t.shape[2:4]))
        out = []
        for b in range(BLOCKS):
            buf = torch.empty(LAYOUT.block_bytes, dtype=torch.uint8)
            kv.gather(b, buf)
            out.append(buf)
        blocks[(name, kt)] = out
    first = blocks[("LBHNC", None)]
    assert first[2].view(DT).view(LAYERS, HEADS, TOKENS, 2 * D).equal(content[:, 2])
    for key, got in blocks.items():
        assert all(torch.equal(a, b) for a, b in zip(first, got, strict=True)), key


def test_kernel_blocks_of_a_logical_block() -> None:
    _, views = vllm_views("LBNHC", 8)
    kv = PagedKv({f"l{i}": v for i, v in enumerate(views)}, LAYOUT)
    assert kv.kernel_blocks_per_block == 4 and views[0].shape[0] == 4 * BLOCKS
    assert list(kv.kernel_block_ids(2)) == [8, 9, 10, 11]
    src = torch.randint(0, 256, (LAYOUT.block_bytes,), dtype=torch.uint8)
    kv.scatter(2, src)
    touched = [kb for kb in range(4 * BLOCKS) if views[1][kb].contiguous().view(torch.uint8).any()]
    assert touched == [8, 9, 10, 11]  # the four kernel blocks of block 2, no other
    # their tokens in order: kernel block 8 + k holds tokens 8k..8k+7 of layer 1's [heads, 32 tokens, K|V]
    layer1 = src[LAYOUT.block_bytes // LAYERS : 2 * LAYOUT.block_bytes // LAYERS].view(HEADS, TOKENS, 2 * D * 2)
    for k in range(4):  # compared as bytes: random bytes make NaNs, which are unequal to themselves
        assert torch.equal(views[1][8 + k].contiguous().view(torch.uint8), layer1[:, 8 * k : 8 * k + 8])


def test_tensor_parallel_ranks_move_their_own_shards() -> None:
    """A 4-head cache split by heads over 2 ranks: each rank gathers its shard of a block under its own layout
    (its own region: name and layout string), both under the block's one digest; scattering the shards on
    another engine's ranks rebuilds the same block."""
    full_layout = KvLayout("m", str(DT), TOKENS, LAYERS, 4, D)
    full = [torch.randn(BLOCKS, 4, TOKENS, 2 * D).to(DT) for _ in range(LAYERS)]
    shard = KvLayout("m", str(DT), TOKENS, LAYERS, 2, D, tp_size=2)
    ranks = [with_rank(shard, r) for r in range(2)]
    assert ranks[0].describe() != ranks[1].describe() and ranks[0].identity() == ranks[1].identity()
    assert block_salt(ranks[0], None, None) == block_salt(ranks[1], None, None) != block_salt(full_layout, None, None)
    assert [shard_region_name("kvmesh-1-tier", lay) for lay in ranks] == ["kvmesh-1-tier-tp0", "kvmesh-1-tier-tp1"]
    assert shard_region_name("kvmesh-1-tier", full_layout) == "kvmesh-1-tier"
    with pytest.raises(ValueError, match="tp_rank 2"):
        with_rank(shard, 2)
    sent = []
    for r, lay in enumerate(ranks):  # each rank's tensors: its heads only (vLLM allocates them per rank)
        kv = PagedKv({f"l{i}": t[:, 2 * r : 2 * r + 2].clone() for i, t in enumerate(full)}, lay)
        assert kv.block_bytes == lay.block_bytes == full_layout.block_bytes // 2
        buf = torch.empty(lay.block_bytes, dtype=torch.uint8)
        kv.gather(3, buf)
        sent.append(buf)
    received = [[torch.zeros(BLOCKS, 2, TOKENS, 2 * D, dtype=DT) for _ in range(LAYERS)] for _ in ranks]
    for r, lay in enumerate(ranks):
        PagedKv({f"l{i}": t for i, t in enumerate(received[r])}, lay).scatter(5, sent[r])
    for i in range(LAYERS):
        rebuilt = torch.cat([received[0][i][5], received[1][i][5]], dim=0)
        assert torch.equal(rebuilt, full[i][3])


def test_mla_latent_caches() -> None:
    latent = 96
    mla = KvLayout("m", str(DT), TOKENS, LAYERS, 1, latent, head_size_v=0)
    assert mla.block_bytes == LAYERS * TOKENS * latent * 2
    assert "Dv=0" in mla.describe() and mla.describe() != KvLayout("m", str(DT), TOKENS, LAYERS, 1, latent).describe()
    vllm_shaped = [torch.randn(BLOCKS, 1, TOKENS, latent).to(DT) for _ in range(LAYERS)]
    headless = [t.squeeze(1).clone() for t in vllm_shaped]
    bufs = []
    for caches in (vllm_shaped, headless):
        kv = PagedKv({f"l{i}": t for i, t in enumerate(caches)}, mla)
        buf = torch.empty(mla.block_bytes, dtype=torch.uint8)
        kv.gather(4, buf)
        bufs.append(buf)
    assert torch.equal(bufs[0], bufs[1])
    assert torch.equal(bufs[0][: TOKENS * latent * 2].view(DT), vllm_shaped[0][4].flatten())
    with pytest.raises(UnsupportedLayout, match=r"'l0'.*shape \[6, 1, 32, 192\]"):  # K and V: not a latent cache
        PagedKv({f"l{i}": torch.zeros(BLOCKS, 1, TOKENS, 2 * latent, dtype=DT) for i in range(LAYERS)}, mla)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        ({"mamba": torch.zeros(4096, dtype=DT)}, r"'mamba': shape \[4096\].*unknown shape"),
        ({"raw": torch.zeros(4096, dtype=torch.int8)}, "its elements are torch.int8, the layout's torch.bfloat16"),
        ({"l0": torch.zeros(BLOCKS, 3, TOKENS, 2 * D, dtype=DT)}, r"shape \[6, 3, 32, 16\].*unknown shape"),
        ({"l0": torch.zeros(BLOCKS, HEADS, TOKENS, 2 * D, dtype=torch.float16)}, "torch.float16"),
        ({"l0": torch.zeros(BLOCKS, HEADS, 12, 2 * D, dtype=DT)}, "12 tokens per kernel block do not divide"),
        ({"l0": torch.zeros(7, HEADS, 16, 2 * D, dtype=DT)}, "7 kernel blocks are not whole blocks of 2"),
        ({"l0": torch.zeros(BLOCKS, HEADS, TOKENS, 2 * D, dtype=DT)}, r"hold 2048 B per block over 1 layers"),
        ({}, "no KV cache tensors"),
    ],
)
def test_arrangements_it_cannot_copy_are_refused_in_one_line(tensors: dict[str, Any], match: str) -> None:
    with pytest.raises(UnsupportedLayout, match=match) as info:
        PagedKv(tensors, LAYOUT)
    assert "\n" not in str(info.value)


def test_without_a_layout_blocks_are_copied_as_registered() -> None:
    """The CPU backend's contiguous tensors, as the connector registered them before layouts were read."""
    caches = {f"l{i}": torch.randn(BLOCKS, HEADS, TOKENS, 2 * D).to(DT) for i in range(LAYERS)}
    caches["shared"] = caches["l0"]  # one tensor under two layer names is copied once
    kv = PagedKv(caches)
    assert len(kv.layers) == LAYERS and kv.block_bytes == LAYOUT.block_bytes
    buf = torch.empty(kv.block_bytes, dtype=torch.uint8)
    kv.gather(1, buf)
    assert torch.equal(buf.view(DT)[: HEADS * TOKENS * 2 * D].view(HEADS, TOKENS, 2 * D), caches["l0"][1])
    with pytest.raises(IndexError, match="block_id 6"):
        kv.gather(BLOCKS, buf)
    with pytest.raises(ValueError, match="need 6144 uint8"):
        kv.scatter(0, buf[:10])


def test_host_staging_and_the_tier_path_on_cpu() -> None:
    case = Case(LAYOUT, CPU, lambda dev: vllm_views("LBNHC", 16), canon_blocks(2), seed=3)
    check_staging(CPU, case)  # save 2 blocks, load them elsewhere: equal to the CPU copies
    assert check_tier(CPU, case) == "TierRegion"  # device -> staging -> tier region -> staging -> device
    staging = HostStaging(case.kv, slots=1)
    assert not staging.pinned and staging.stream is None
    assert staging.save([0]).done()
    assert bytes(staging.slot_bytes(0)) == bytes(staging.slot(0).numpy())
    with pytest.raises(ValueError, match="2 blocks do not fit 1 staging slots"):
        staging.load([0, 1])
    with pytest.raises(ValueError, match="slots must be >= 1"):
        HostStaging(case.kv, slots=0)


def _config(**model: Any) -> Any:
    mc = SimpleNamespace(model="org/m", dtype=DT, use_mla=False, **model)
    mc.get_num_layers = lambda pc: 4
    mc.get_num_kv_heads = lambda pc: 8 // getattr(pc, "tensor_parallel_size", 1)
    mc.get_head_size = lambda: 64
    return mc


def test_layout_from_vllms_config() -> None:
    cc = SimpleNamespace(block_size=16, cache_dtype="auto")
    lay = layout_from_vllm(SimpleNamespace(model_config=_config(), parallel_config=SimpleNamespace(), cache_config=cc))
    assert lay == KvLayout("org/m", "torch.bfloat16", 16, 4, 8, 64)
    assert lay.describe() == "LBHNC;bs=16;dt=torch.bfloat16;L=4;H=8;D=64;tp=0/1;m=" + lay.describe()[-16:]
    pc = SimpleNamespace(rank=3, tensor_parallel_size=2)
    fp8 = SimpleNamespace(block_size=16, cache_dtype="fp8_e4m3")
    tp = layout_from_vllm(SimpleNamespace(model_config=_config(), parallel_config=pc, cache_config=fp8))
    assert (tp.tp_rank, tp.tp_size, tp.num_kv_heads, tp.dtype) == (1, 2, 4, "torch.uint8")
    mc = _config()
    mc.use_mla = True
    mla = layout_from_vllm(SimpleNamespace(model_config=mc, parallel_config=SimpleNamespace(), cache_config=cc))
    assert mla.head_size_v == 0 and mla.block_bytes == 4 * 8 * 16 * 64 * 2


def test_device_check_self_test_runs_without_vllm(tmp_path: Path) -> None:
    """The script as a GPU machine runs it (python + torch, vLLM and crc32c absent), on CPU tensors."""
    for blocked in ("vllm", "crc32c"):
        (tmp_path / blocked).mkdir()
        (tmp_path / blocked / "__init__.py").write_text(f"raise ImportError('{blocked} is not installed here')\n")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path)}
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(ROOT / "scripts" / "device_check.sh"), "--device", "cpu", "--mib", "4", "--repeats", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    assert time.monotonic() - t0 < 20
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["bench"] == "device_check" and report["ok"] is True and report["failed"] == []
    assert report["vllm_imported"] is False and report["cuda"] is False
    assert report["tier"] == "shared-memory stand-in"  # TierRegion needs crc32c
    assert {f"layout:{n}" for n in VLLM_LAYOUTS} | {"staging", "tier", "rates"} <= set(report["checks"])
    assert {"layout:LBNHC/kernel16", "layout:2BNHD", "layout:MLA"} <= set(report["checks"])
    assert set(report["gbps"]) == {"h2d_pinned", "h2d_pageable", "d2h_pinned", "d2h_pageable", "d2d"}
    assert all(v > 0 for v in report["gbps"].values())
