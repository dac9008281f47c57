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
block CRC32C-checked (`kvmesh.bench.kvsync.time_pulls`), before the traffic starts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import grpc.aio

from kvmesh.bench import kvsync as kvsync_bench
from kvmesh.bench import netns
from kvmesh.bench.delay_proxy import ProxyProcess
from kvmesh.bench.zone_follow import quantile, scrape, total
from kvmesh.kvplane.kvsync.client import KvSyncClient
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc as cm_grpc

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
) -> dict[str, float]:
    """p50/p99 of a 32-block pull across the emulated link (see the module docstring); `transport` mooncake:
    through the peer's Mooncake TE, its two ports behind proxies with the same delay and cap
    (`kvsync.mooncake_relays`), every block still CRC32C-checked."""
    size = kvsync_bench.tiny_block_bytes()
    over_te = transport == "mooncake"
    peer = kvsync_bench.start_peer(
        size, host=zone.ns_ip, ns=zone.ns, transport=transport if over_te else "shm", mooncake_host="127.0.0.1"
    )
    proxy = None
    relays = kvsync_bench.mooncake_relays(peer, zone.ns_ip, delay_ms, rate) if over_te else []
    try:
        proxy = ProxyProcess(f"{zone.ns_ip}:{json.loads(peer.first)['port']}", delay_ms, rate=rate)
        async with grpc.aio.insecure_channel(proxy.address, options=kvsync_bench.CHANNEL_OPTS) as ch:
            samples, _, _ = await kvsync_bench.time_pulls(
                KvSyncClient(ch), size, SYNC_BLOCKS, False, iters, 10.0, transport=transport, registered=over_te
            )
    finally:
        if proxy is not None:
            proxy.close()
        for relay in relays:
            relay.stop()
        peer.stop()
    return {
        "p50": round(kvsync_bench.percentile(samples, 50) * 1e3, 3),
        "p99": round(kvsync_bench.percentile(samples, 99) * 1e3, 3),
        "samples": len(samples),
        "block_bytes": size,
    }


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


def rewarm_hold(failover: ServiceProcess, host: str) -> dict[str, Any]:
    """How the failover service held the restored zone's ramp for its re-warm: seconds from the restore to the
    ramp's start and why it ended (`warm`: nothing pending any more; `timeout`), from
    `kvmesh_failover_rewarm_hold_seconds`; None when it saw no hold end."""
    samples = scrape(failover.http_port, host)
    name = "kvmesh_failover_rewarm_hold_seconds"
    for outcome in ("warm", "timeout"):
        n = total(samples, f"{name}_count", outcome=outcome)
        if n:
            return {"outcome": outcome, "seconds": round(total(samples, f"{name}_sum", outcome=outcome) / n, 3)}
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
