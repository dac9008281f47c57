"""The connector's block copies on a GPU, checked against CPU copies, and the host <-> device copy rates:
``scripts/device_check.sh`` (``PYTHONPATH=libs python3 -m kvmesh.kvplane.vllm_connector.device_check``).

Made for a machine with an NVIDIA GPU and PyTorch but no vLLM and no package registry: it imports torch,
numpy and kvmesh's pure modules only (never vLLM: the output says so, and the run fails if it did). Without
a GPU (or with ``--device cpu``) it runs the same checks on CPU tensors: a self-test the unit tests run.

Checks, each on the device against the same copy on CPU tensors (byte-exact):

- ``layout:<name>``: a paged KV cache arranged as vLLM arranges it under each `KVCacheLayout` (LBHNC, LBNHC,
  LHBNC, BLHNC, BLNHC, BHLNC; `vllm_layout_views` is a stand-in for vLLM's allocator, computing the same
  strides, which a unit test compares with vLLM's own), with kernel blocks of half the block where vLLM
  allows splitting, FlashAttention's K/V planes ``[2, blocks, tokens, heads, D]``, and MLA latent caches:
  `PagedKv.gather` of a block gives the block format's bytes (known content), `scatter` writes exactly that
  block (the whole backing buffer then equals the CPU reference's).
- ``staging``: `HostStaging` (page-locked on a GPU) saves blocks to host slots and loads them into others,
  asynchronously on its copy stream.
- ``tier``: a block from the device cache through staging into a tier region (`TierRegion`; a plain
  shared-memory segment, named as a stand-in, where the tier's checksum package is absent), read back,
  loaded into the device cache.

Rates (GB/s, best of ``--repeats``): pinned and pageable host -> device and device -> host, against the
device's own device -> device copy. One JSON line; exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvmesh.kvplane.vllm_connector.blocks import HostStaging, PagedKv
from kvmesh.kvplane.vllm_connector.layout import KvLayout

# vLLM's KVCacheLayout: the physical order of the logical axes [L, B, H, N, C] (vllm/v1/kv_cache_layout.py)
VLLM_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
SPLITTABLE = ("LBHNC", "LBNHC")  # vLLM splits blocks into kernel blocks only where a block is one dense page


def vllm_layout_views(
    name: str,
    num_layers: int,
    num_blocks: int,
    heads: int,
    tokens: int,
    token_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kernel_tokens: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A stand-in for vLLM's KV cache allocation (`allocate_kv_cache` / `create_kv_cache_views`) of one
    group of `num_layers` full-attention layers under layout `name`: one zeroed int8 backing buffer and each
    layer's logical ``[blocks, heads, tokens, token_size]`` view with vLLM's strides (with `kernel_tokens`,
    ``[blocks * r, heads, kernel_tokens, ...]``)."""
    order = VLLM_LAYOUTS[name]
    cell = token_size * torch.empty((), dtype=dtype).element_size()
    r = 1
    if kernel_tokens is not None and kernel_tokens != tokens:
        if name not in SPLITTABLE or tokens % kernel_tokens:
            raise ValueError(f"vLLM does not split {name} blocks of {tokens} tokens into {kernel_tokens}")
        r = tokens // kernel_tokens
    shape = (num_layers, num_blocks * r, heads, tokens // r, cell)
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.zeros(step, dtype=torch.int8, device=device)
    view5 = torch.as_strided(raw, shape, strides)
    return raw, [view5[i].view(dtype) for i in range(num_layers)]


class Checks:
    """Named checks; a failure is recorded (its first line), the others still run."""

    def __init__(self) -> None:
        self.results: dict[str, str] = {}

    def run(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            self.results[name] = "ok"
        except Exception as e:  # every failure is reported in the JSON line, the run goes on
            self.results[name] = f"FAIL: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    @property
    def ok(self) -> bool:
        return bool(self.results) and all(v == "ok" for v in self.results.values())


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.detach().cpu().contiguous().view(torch.uint8), b.detach().cpu().contiguous().view(torch.uint8))


Build = Callable[[torch.device], tuple[torch.Tensor, list[torch.Tensor]]]  # -> backing buffer, layer views
Canon = Callable[[list[torch.Tensor], int], torch.Tensor]  # (layer views, block) -> the block format's bytes


class Case:
    """One cache arrangement: the same cache on `device` and on the CPU (the reference), filled with random
    content; `canon` gives a block's expected bytes from the reference's layer views by plain indexing."""

    def __init__(self, layout: KvLayout, device: torch.device, build: Build, canon: Canon, seed: int) -> None:
        self.layout = layout
        self.raw, views = build(device)
        self.ref_raw, self.ref_views = build(torch.device("cpu"))
        self.kv = PagedKv({f"layer.{i}": v for i, v in enumerate(views)}, layout)
        self.ref = PagedKv({f"layer.{i}": v for i, v in enumerate(self.ref_views)}, layout)
        gen = torch.Generator().manual_seed(seed)
        for t in self.ref_views:
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        self.raw.copy_(self.ref_raw)
        self.canon = canon
        self.fresh = torch.randint(0, 256, (layout.block_bytes,), generator=gen, dtype=torch.uint8)

    def check_copies(self, device: torch.device) -> None:
        n = self.kv.num_blocks
        for b in (0, n // 2, n - 1):
            out = torch.zeros(self.kv.block_bytes, dtype=torch.uint8, device=device)
            self.kv.gather(b, out)
            ref = torch.zeros(self.ref.block_bytes, dtype=torch.uint8)
            self.ref.gather(b, ref)
            _expect(torch.equal(out.cpu(), ref), f"gather of block {b} differs from the CPU gather")
            _expect(torch.equal(ref, self.canon(self.ref_views, b)), f"block {b} is not in the block format")
        b = n - 2
        self.kv.scatter(b, self.fresh.to(device))
        self.ref.scatter(b, self.fresh)
        _expect(_bytes_equal(self.raw, self.ref_raw), f"scatter of block {b} differs from the CPU scatter")
        back = torch.zeros(self.kv.block_bytes, dtype=torch.uint8, device=device)
        self.kv.gather(b, back)
        _expect(torch.equal(back.cpu(), self.fresh), f"block {b} does not read back as written")


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).flatten()


def canon_blocks(kernel_blocks: int) -> Canon:
    """Expected bytes of a block of vLLM's logical `[blocks * kernel_blocks, H, n, K|V]` views: each layer's
    kernel blocks' tokens in order, `[H, N, K|V]`."""

    def canon(views: list[torch.Tensor], b: int) -> torch.Tensor:
        r = kernel_blocks
        return torch.cat([_flat(torch.cat([v[b * r + k] for k in range(r)], dim=1)) for v in views])

    return canon


def canon_planes(views: list[torch.Tensor], b: int) -> torch.Tensor:
    """Expected bytes of a block of `[2, blocks, tokens, H, D]` views: `[H, tokens, K|V]` per layer."""
    return torch.cat([_flat(torch.cat([v[0, b], v[1, b]], dim=-1).transpose(0, 1)) for v in views])


def canon_latent(views: list[torch.Tensor], b: int) -> torch.Tensor:
    """Expected bytes of an MLA block: the latent cache's block as it is."""
    return torch.cat([_flat(v[b]) for v in views])


def stacked(dims: tuple[int, ...], layers: int, dtype: torch.dtype) -> Build:
    """`layers` contiguous caches of shape `dims` in one backing buffer."""

    def build(dev: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
        n = layers
        for d in dims:
            n *= d
        raw = torch.zeros(n, dtype=dtype, device=dev)
        return raw, list(raw.view(layers, *dims).unbind(0))

    return build


def cases(device: torch.device) -> dict[str, Case]:
    """Every arrangement `PagedKv` supports, as small caches (4 layers, 8 blocks of 32 tokens)."""
    layers, blocks, heads, tokens, d, latent = 4, 8, 2, 32, 64, 576
    dt = torch.bfloat16
    base = KvLayout("device-check", str(dt), tokens, layers, heads, d)
    mla = KvLayout("device-check", str(dt), tokens, layers, 1, latent, head_size_v=0)
    out: dict[str, Case] = {}
    for name in VLLM_LAYOUTS:
        for kt in (None, tokens // 2) if name in SPLITTABLE else (None,):

            def build(
                dev: torch.device, name: str = name, kt: int | None = kt
            ) -> tuple[torch.Tensor, list[torch.Tensor]]:
                return vllm_layout_views(name, layers, blocks, heads, tokens, 2 * d, dt, dev, kt)

            label = f"layout:{name}" + (f"/kernel{kt}" if kt else "")
            out[label] = Case(base, device, build, canon_blocks(tokens // kt if kt else 1), len(out))
    # FlashAttention's K/V planes (vLLM before KVCacheLayout)
    out["layout:2BNHD"] = Case(base, device, stacked((2, blocks, tokens, heads, d), layers, dt), canon_planes, 100)
    # MLA latent caches: vLLM's [blocks, 1, tokens, latent] and the head-less [blocks, tokens, latent]
    out["layout:MLA"] = Case(mla, device, stacked((blocks, 1, tokens, latent), layers, dt), canon_latent, 101)
    out["layout:MLA-BNC"] = Case(mla, device, stacked((blocks, tokens, latent), layers, dt), canon_latent, 102)
    return out


def check_staging(device: torch.device, case: Case) -> None:
    n = case.kv.num_blocks
    saved, loaded = (1, n - 1), (2, n - 2)
    staging = HostStaging(case.kv, slots=2)
    _expect(staging.pinned == (device.type == "cuda"), f"staging pinned={staging.pinned} on {device}")
    staging.save(saved).wait()
    for i, b in enumerate(saved):
        ref = torch.zeros(case.ref.block_bytes, dtype=torch.uint8)
        case.ref.gather(b, ref)
        _expect(torch.equal(staging.slot(i), ref), f"staged block {b} differs from the CPU gather")
    done = staging.load(loaded)  # slot i -> block loaded[i]
    done.wait_on()
    done.wait()
    _expect(done.done(), "a waited copy is not done")
    for i, b in enumerate(loaded):
        case.ref.scatter(b, staging.slot(i))
    _expect(_bytes_equal(case.raw, case.ref_raw), "staged loads differ from the CPU scatter")


def check_tier(device: torch.device, case: Case) -> str:
    """A block device -> staging -> tier region -> staging -> device; returns which tier was used."""
    staging = HostStaging(case.kv, slots=1)
    staging.save([3]).wait()
    sent = staging.slot(0).clone()
    try:
        from kvmesh.kvplane.kvsync.tier import RegionReader, TierRegion, region_name
    except ImportError:  # the tier's checksum package (crc32c) is not in a plain torch install
        return _check_shm_standin(staging, case, sent)
    digest = bytes(range(32))
    region = TierRegion.create(region_name("devcheck"), case.kv.block_bytes, 2, case.layout.describe())
    try:
        region.put(digest, staging.slot_bytes(0), time.monotonic_ns())
        staging.slot(0).zero_()
        reader = RegionReader.attach(region.shm_name, expect_layout=case.layout.describe())
        try:
            (ref,) = reader.locate([digest])
            _expect(ref is not None, "the put block is not in the region")
            assert ref is not None
            reader.read_into(ref, digest, staging.slot_bytes(0), verify=True)
        finally:
            reader.close()
    finally:
        region.close(unlink=True)
    _finish_tier(staging, case, sent)
    return "TierRegion"


def _check_shm_standin(staging: HostStaging, case: Case, sent: torch.Tensor) -> str:
    from multiprocessing import shared_memory

    n = case.kv.block_bytes
    shm = shared_memory.SharedMemory(create=True, size=n)
    try:
        assert shm.buf is not None
        shm.buf[:n] = staging.slot_bytes(0)
        staging.slot(0).zero_()
        staging.slot_bytes(0)[:] = shm.buf[:n]
    finally:
        shm.close()
        shm.unlink()
    _finish_tier(staging, case, sent)
    return "shared-memory stand-in"


def _finish_tier(staging: HostStaging, case: Case, sent: torch.Tensor) -> None:
    _expect(torch.equal(staging.slot(0), sent), "the block read from the tier differs from the put one")
    staging.load([0]).wait()  # the block as read back -> block 0
    case.ref.scatter(0, sent)
    _expect(_bytes_equal(case.raw, case.ref_raw), "the block loaded from the tier differs from the CPU scatter")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rate(copy: Callable[[], object], nbytes: int, device: torch.device, repeats: int) -> float:
    """GB/s of `copy` (moving `nbytes`), best of `repeats` after one warm-up."""
    copy()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        copy()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return round(nbytes / best / 1e9, 2)


def rates(device: torch.device, mib: int, repeats: int) -> dict[str, float]:
    """Host <-> device GB/s from pinned and pageable memory, and the device's own copy rate."""
    n = mib << 20
    dev_a = torch.empty(n, dtype=torch.uint8, device=device)
    dev_b = torch.empty(n, dtype=torch.uint8, device=device)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    pageable = torch.empty(n, dtype=torch.uint8)
    pinned.fill_(1)
    pageable.fill_(2)
    dev_a.fill_(3)
    nb = device.type == "cuda"
    out = {
        "h2d_pinned": _rate(lambda: dev_b.copy_(pinned, non_blocking=nb), n, device, repeats),
        "h2d_pageable": _rate(lambda: dev_b.copy_(pageable), n, device, repeats),
        "d2h_pinned": _rate(lambda: pinned.copy_(dev_a, non_blocking=nb), n, device, repeats),
        "d2h_pageable": _rate(lambda: pageable.copy_(dev_a), n, device, repeats),
        "d2d": _rate(lambda: dev_b.copy_(dev_a), n, device, repeats),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="device_check", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cuda, cuda:N or cpu")
    ap.add_argument("--mib", type=int, default=0, help="MiB per rate measurement (default 1024 on a GPU, 32 on CPU)")
    ap.add_argument("--repeats", type=int, default=5, help="timed copies per rate (the best counts)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    checks = Checks()
    all_cases: dict[str, Case] = {}

    def build() -> None:
        all_cases.update(cases(device))

    checks.run("build", build)
    for label, case in all_cases.items():
        checks.run(label, functools.partial(case.check_copies, device))
    tier = "not run"
    if all_cases:
        first = next(iter(all_cases.values()))
        checks.run("staging", lambda: check_staging(device, first))
        holder: dict[str, str] = {}
        checks.run("tier", lambda: holder.update(tier=check_tier(device, first)))
        tier = holder.get("tier", tier)
    mib = args.mib or (1024 if device.type == "cuda" else 32)
    gbps: dict[str, float] = {}
    checks.run("rates", lambda: gbps.update(rates(device, mib, max(1, args.repeats))))
    vllm_imported = any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
    ok = checks.ok and not vllm_imported
    d2d = gbps.get("d2d") or 0.0
    report: dict[str, Any] = {
        "bench": "device_check",
        "ok": ok,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (self-test)",
        "cuda": device.type == "cuda",
        "torch": torch.__version__,
        "layouts": sorted(k.split(":", 1)[1] for k in all_cases),
        "checks": checks.results,
        "failed": sorted(k for k, v in checks.results.items() if v != "ok"),
        "tier": tier,
        "pinned": device.type == "cuda",
        "rate_mib": mib,
        "gbps": gbps,
        "pinned_h2d_vs_d2d": round(gbps.get("h2d_pinned", 0.0) / d2d, 4) if d2d else None,
        "vllm_imported": vllm_imported,
        "elapsed_s": round(time.perf_counter() - t0, 2),
    }
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
