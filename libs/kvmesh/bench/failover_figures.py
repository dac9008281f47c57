"""The zone figures of the failover bench (`kvmesh.bench.failover`): hit ratios of zone A's sessions around
a switch, the cross-zone sync of a block batch, index-following lag, replication bytes, and the cache-managers'
follow and replication counters that show a partition healed without a full resend.

Hit ratio of a set of requests = Σ cached prompt tokens / Σ prompt tokens (the router's usage, as the worker
that served each request counted it). Zone A's sessions are the clients whose own zone is A:
* `pre_switch_hit_ratio`: those served by A before the kill, each session's first turn left out (a cold start
  of the bench, not a property of the zone);
* `post_switch_hit_ratio`: those served by another zone in the first `POST_SWITCH_WINDOW_S` after the kill
  (and before A's restore); `post_switch_first_hit_ratio`: only each session's first request there;
* `failback_hit_ratio`: those served by the restored zone A; `failback_first_hit_ratio`: only each session's
  first request there (the restored zone starts empty: what it holds then came from the other zone).
`cross_zone_sync_ms`: a kv-sync peer (`kvmesh.kvplane.kvsync.peer`, tiny-model blocks) in zone A's namespace, pulled
from the root namespace through a proxy with the inter-zone link's delay and cap, 32 blocks per pull, every
block CRC32C-checked, before the traffic starts, the way replication pulls a prefix: the lease taken next to
the peer (a `KvSyncClient` on a direct channel into the zone, as the replicating cache-manager leases at its
source worker), carried as a `ReplicaPrefix.lease` is (wall-clock end, `kvmesh.wire.proto`), and the pull
timed alone, made by the worker's own `PeerPulls` under that lease through the link (`lease_p50`/`lease_p99`:
the lease call inside the zone, not part of the pull). `cross_zone_sync_unleased_ms`: the same pulls each
leasing for itself through the link, as before, taking turns with the leased ones (the same load for both).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from typing import Any

import grpc.aio
import numpy as np

from kvmesh.bench import kvsync as kvsync_bench
from kvmesh.bench import netns
from kvmesh.bench.delay_proxy import ProxyProcess
from kvmesh.bench.zone_follow import quantile, scrape, total
from kvmesh.core.pull import KvPull
from kvmesh.kvplane.kvsync import mooncake as te
from kvmesh.kvplane.kvsync.client import KvSyncClient
from kvmesh.kvplane.kvsync.peer import LAYOUT, REGION, peer_digests
from kvmesh.kvplane.pulls import USED, PeerPulls, PullLimits, carry
from kvmesh.rpc.channel import PLAINTEXT
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc as cm_grpc
from kvmesh.wire.proto import held_lease_from_proto, held_lease_to_proto

SYNC_BLOCKS = 32


def hit_ratio(rows: Sequence[Any]) -> float | None:
    prompt = sum(r.prompt_tokens for r in rows)
    return round(sum(r.cached_tokens for r in rows) / prompt, 4) if prompt else None


def hit_figures(
    served: Sequence[Any], home: dict[int, str], zone: str, t_kill: float, t_post_end: float, t_back: float | None
) -> dict[str, Any]:
    """The hit ratios of `zone`'s sessions (see the module docstring)."""
    mine = [r for r in served if home[r.client] == zone]
    pre = [r for r in mine if r.t < t_kill and r.zone == zone and r.turn > 1]
    post = [r for r in mine if t_kill <= r.t < t_post_end and r.zone != zone]
    back = [r for r in mine if t_back is not None and r.t >= t_back and r.zone == zone]
    pre_ratio, post_ratio = hit_ratio(pre), hit_ratio(post)
    return {
        "pre_switch_hit_ratio": pre_ratio,
        "post_switch_hit_ratio": post_ratio,
        "post_switch_first_hit_ratio": hit_ratio(firsts(post)),
        "post_over_pre": round(post_ratio / pre_ratio, 4) if pre_ratio and post_ratio is not None else None,
        "post_switch_requests": len(post),
        "failback_hit_ratio": hit_ratio(back),
        "failback_first_hit_ratio": hit_ratio(firsts(back)),
    }


def firsts(rows: Sequence[Any]) -> list[Any]:
    """Each session's first request among `rows` (in completion order)."""
    first: dict[int, Any] = {}
    for r in rows:
        first.setdefault(r.client, r)
    return list(first.values())


async def sync_probe(
    zone: netns.Zone, delay_ms: float, rate: float, iters: int = 200, transport: str = "grpc"
) -> tuple[dict[str, float], dict[str, float]]:
    """(carried-lease, unleased) p50/p99 of a 32-block pull across the emulated link (see the module
    docstring); `transport` mooncake: through the peer's Mooncake TE, its two ports behind proxies with the
    same delay and cap (`kvsync.mooncake_relays`), every block still CRC32C-checked."""
    size = kvsync_bench.tiny_block_bytes()
    over_te = transport == "mooncake"
    peer = kvsync_bench.start_peer(
        size, host=zone.ns_ip, ns=zone.ns, transport=transport if over_te else "shm", mooncake_host="127.0.0.1"
    )
    proxy = None
    relays = kvsync_bench.mooncake_relays(peer, zone.ns_ip, delay_ms, rate) if over_te else []
    try:
        direct = f"{zone.ns_ip}:{json.loads(peer.first)['port']}"
        proxy = ProxyProcess(direct, delay_ms, rate=rate)
        async with grpc.aio.insecure_channel(direct, options=kvsync_bench.CHANNEL_OPTS) as near:
            carried, unleased, leases = await time_sync_pulls(KvSyncClient(near), proxy.address, size, iters, transport)
    finally:
        if proxy is not None:
            proxy.close()
        for relay in relays:
            relay.stop()
        peer.stop()
    leased = {**_ms(carried), "lease_p50": _ms(leases)["p50"], "lease_p99": _ms(leases)["p99"], "block_bytes": size}
    return leased, {**_ms(unleased), "block_bytes": size}


def _ms(samples: Sequence[float]) -> dict[str, Any]:
    return {
        "p50": round(kvsync_bench.percentile(samples, 50) * 1e3, 3),
        "p99": round(kvsync_bench.percentile(samples, 99) * 1e3, 3),
        "samples": len(samples),
    }


async def time_sync_pulls(
    near: KvSyncClient, far: str, block_bytes: int, iters: int, transport: str, budget_s: float = 10.0
) -> tuple[list[float], list[float], list[float]]:
    """(carried-lease pull, unleased pull, lease) seconds per round, the two pulls taking turns so both see
    the same load: a fresh lease on the peer's blocks from `near` (inside the peer's zone), converted as it
    travels with a replicated prefix, then a worker's `PeerPulls` pull from `far` (through the link) under
    it; and the same pull with no lease (its own lease call through the link). Buffers registered with this
    process's TE for mooncake (a worker's staging region). Raises unless every carried pull read under its
    lease (no lease call)."""
    digests = peer_digests(SYNC_BLOCKS)
    landing = np.zeros(SYNC_BLOCKS * block_bytes, dtype=np.uint8)
    engine = te.engine() if transport == "mooncake" else None
    export = engine.register(memoryview(landing.data)) if engine is not None else None
    whole = memoryview(landing.data)
    outs = [whole[i * block_bytes : (i + 1) * block_bytes] for i in range(SYNC_BLOCKS)]
    peers = PeerPulls(PullLimits(timeout_ms=10_000, lease_ms=10_000, over_shm=False, transport=transport), PLAINTEXT)
    samples: tuple[list[float], list[float], list[float]] = ([], [], [])
    stop = time.monotonic() + budget_s

    async def timed_pull(pull: KvPull) -> float:
        t = time.perf_counter()
        stats = await peers.pull(pull, digests, outs, LAYOUT, 10.0, prefer_shm=False)
        dt = time.perf_counter() - t
        if stats.blocks != SYNC_BLOCKS or stats.transport != transport:
            raise RuntimeError(f"pulled {stats.blocks} of {SYNC_BLOCKS} blocks over {stats.transport}")
        return dt

    try:
        for i in range(iters + 2):  # bounded; the first two are warm-up (channels, TE connection, page faults)
            t = time.perf_counter()
            lease = await near.acquire_lease(REGION, digests, ttl_ms=10_000, timeout_s=10.0)
            lease_s = time.perf_counter() - t
            hint = held_lease_to_proto(carry(lease, time.time(), time.monotonic()))
            carried = await timed_pull(KvPull(source_address=far, region=REGION, lease=held_lease_from_proto(hint)))
            unleased = await timed_pull(KvPull(source_address=far, region=REGION))
            if i >= 2:
                for got, value in zip(samples, (carried, unleased, lease_s), strict=True):
                    got.append(value)
                if len(samples[0]) >= 3 and time.monotonic() > stop:
                    break
    finally:
        await peers.close()
        if engine is not None and export is not None:
            engine.unregister(export)
    if peers.carried[USED] != len(samples[0]) + 2 or sum(peers.carried.values()) != peers.carried[USED]:
        raise RuntimeError(f"not every pull read under its carried lease: {dict(peers.carried)}")
    return samples


def lag_ms(cm: ServiceProcess, host: str, followed: str) -> dict[str, float]:
    """Index-following lag of `followed` at `cm`, from its histogram (linear within buckets)."""
    samples = scrape(cm.http_port, host)
    name = "kvmesh_cache_zone_follow_lag_seconds"
    buckets = sorted(
        (float(lab["le"]), v) for lab, v in samples.get(f"{name}_bucket", []) if lab.get("zone") == followed
    )
    return {
        "p50": round(quantile(0.5, buckets) * 1e3, 3),
        "p99": round(quantile(0.99, buckets) * 1e3, 3),
        "samples": int(total(samples, f"{name}_count", zone=followed)),
    }


REWARM_HOLD = "kvmesh_failover_rewarm_hold_seconds"
REWARM_OUTCOMES = ("warm", "timeout")


def rewarm_holds(failover: ServiceProcess, host: str) -> dict[str, tuple[float, float]]:
    """{outcome: (count, sum of seconds)} of the re-warm holds the failover service has timed so far (each
    zone's first start is timed too: take one reading before the restore and pass it to `rewarm_hold`)."""
    samples = scrape(failover.http_port, host)
    return {
        o: (total(samples, f"{REWARM_HOLD}_count", outcome=o), total(samples, f"{REWARM_HOLD}_sum", outcome=o))
        for o in REWARM_OUTCOMES
    }


def rewarm_hold(failover: ServiceProcess, host: str, before: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """How the failover service held the restored zone's ramp for its re-warm: seconds from the restore to the
    ramp's start and why it ended (`warm`: nothing pending any more; `timeout`), from the holds of
    `kvmesh_failover_rewarm_hold_seconds` timed since the reading `before`; None when no hold ended since."""
    after = rewarm_holds(failover, host)
    for o in REWARM_OUTCOMES:
        n = after[o][0] - before[o][0]
        if n:
            return {"outcome": o, "seconds": round((after[o][1] - before[o][1]) / n, 3)}
    return {"outcome": None, "seconds": None}


def replication_bytes(cm: ServiceProcess, host: str) -> float:
    return total(scrape(cm.http_port, host), "kvmesh_cache_replication_bytes_total")


def replicas_pulled(cm: ServiceProcess, host: str) -> float:
    return total(scrape(cm.http_port, host), "kvmesh_cache_replicas_received_total", outcome="pulled")


async def cache_manager_stats(cm: ServiceProcess) -> pb.GetStatsResponse:
    async with grpc.aio.insecure_channel(cm.address) as ch:
        return await cm_grpc.CacheManagerServiceStub(ch).GetStats(pb.GetStatsRequest(), timeout=5)


async def convergence(cms: Sequence[tuple[ServiceProcess, str]]) -> dict[str, Any]:
    """What the cache-managers' follow and replication counters say (after a partition healed): snapshots
    and resumed streams of the followed zones, prefixes replicated and replicas pulled by the receivers (a
    prefix replicated once is pulled once: more pulls than prefixes would be a resend)."""
    stats = [await cache_manager_stats(cm) for cm, _host in cms]
    return {
        "index_snapshots": sum(z.snapshots for s in stats for z in s.followed_zones),
        "index_resumes": sum(z.resumes for s in stats for z in s.followed_zones),
        "followed_connected": all(z.connected for s in stats for z in s.followed_zones),
        "replicated_prefixes": sum(t.prefixes for s in stats for t in s.replication),
        "replicas_pulled": int(sum(replicas_pulled(cm, host) for cm, host in cms)),
    }


def nan_to_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}
