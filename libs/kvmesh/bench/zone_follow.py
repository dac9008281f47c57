"""Index following between zones: the lag of zone B's copy of zone A's index, and a partition's catch-up.

    python -m kvmesh.bench zone-follow [--delay-ms 1] [--batches-per-s 200] [--blocks-per-batch 4]
                                       [--duration 10] [--partition-s 0]

Two cache-manager processes: A (zone a) and B (zone b, `--follow-zone a=` the link), the link a
`kvmesh.bench.delay_proxy` process adding `--delay-ms` each way. This process publishes live KV event batches
to A as a worker does (PublishKvEvents, each batch storing `--blocks-per-batch` new blocks) at
`--batches-per-s` for `--duration` s. B's lag histogram (`kvmesh_cache_zone_follow_lag_seconds`: apply time
in B − ingest time in A) gives `index_lag_ms` p50/p99 (linear within its buckets, as Prometheus'
`histogram_quantile`) and its mean. With `--partition-s P` the link is cut for P s in the middle of the run
(publishing goes on) and then healed: `partition` reports how B came back (resumed streams and snapshots
A sent, the deltas of the resumed stream, and the time from the heal until B's copy holds A's newest
prefix; publishing waits for that). The lag figures then include the partition's deltas (their real lag):
measure the steady state without one.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.bench.delay_proxy import ProxyProcess
from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import cache_manager_pb2 as pb
from kvmesh.v1 import cache_manager_pb2_grpc as cm_grpc
from kvmesh.v1 import common_pb2

BS = 16
MODEL = "bench-zone"
CM_FLAGS = ("--block-size", str(BS), "--model", MODEL, "--checkpoint-interval-s", "0", "--warm-interval-s", "0")


def scrape(port: int, host: str = "127.0.0.1") -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a /metrics page by sample name."""
    body = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


def quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float:
    """`histogram_quantile(q)` over cumulative (upper bound, count) buckets, sorted by bound."""
    n = buckets[-1][1] if buckets else 0.0
    if n == 0:
        return math.nan
    rank, lo, below = q * n, 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lo
            return lo + (bound - lo) * (rank - below) / max(count - below, 1e-12)
        lo, below = bound, count
    return lo


def lag_ms(samples: dict[str, list[tuple[dict[str, str], float]]]) -> dict[str, float]:
    name = "kvmesh_cache_zone_follow_lag_seconds"
    buckets = sorted((float(lab["le"]), v) for lab, v in samples.get(f"{name}_bucket", []) if lab.get("zone") == "a")
    count, s = total(samples, f"{name}_count", zone="a"), total(samples, f"{name}_sum", zone="a")
    return {
        "p50": round(quantile(0.5, buckets) * 1e3, 3),
        "p99": round(quantile(0.99, buckets) * 1e3, 3),
        "mean": round(s / count * 1e3, 3) if count else math.nan,
        "samples": int(count),
    }


class Publisher:
    """A worker's PublishKvEvents stream to A: one chain of new blocks, `k` per batch."""

    def __init__(self, stub: cm_grpc.CacheManagerServiceStub, k: int) -> None:
        self.k, self.seq = k, 0
        self.parent: int | None = None
        self.queue: asyncio.Queue[pb.PublishKvEventsRequest | None] = asyncio.Queue()
        self.tokens: list[int] = []
        self.call = stub.PublishKvEvents(self._requests())

    async def _requests(self) -> AsyncIterator[pb.PublishKvEventsRequest]:
        yield pb.PublishKvEventsRequest(hello=pb.WorkerHello(worker_id="w-a", instance_id="i1", block_size=BS))
        while (req := await self.queue.get()) is not None:
            yield req

    async def start(self) -> None:
        await self.call.read()  # the hello's ack

    async def batch(self) -> None:
        toks = list(range(len(self.tokens), len(self.tokens) + self.k * BS))
        hashes = [1_000_000 + self.seq * self.k + i for i in range(self.k)]
        ev = common_pb2.BlockStored(block_hashes=hashes, token_ids=toks, block_size=BS)
        if self.parent is not None:
            ev.parent_block_hash = self.parent
        batch = common_pb2.KvEventBatch(
            worker_id="w-a", instance_id="i1", sequence=self.seq, events=[common_pb2.KvEvent(block_stored=ev)]
        )
        await self.queue.put(pb.PublishKvEventsRequest(kind=common_pb2.KV_STREAM_KIND_LIVE, batch=batch))
        ack = await self.call.read()
        assert not ack.resync_required, ack
        self.tokens += toks
        self.seq, self.parent = self.seq + 1, hashes[-1]

    async def close(self) -> None:
        await self.queue.put(None)
        self.call.cancel()


async def b_holds(stub: cm_grpc.CacheManagerServiceStub, tokens: list[int]) -> bool:
    req = pb.FindMatchesRequest(token_ids=common_pb2.TokenIds(ids=tokens), model=MODEL, all_zones=True)
    r = await stub.FindMatches(req, timeout=5)
    return any(m.zone == "a" and m.matched_blocks == len(tokens) // BS for m in r.matches)


async def wait_for(stub: cm_grpc.CacheManagerServiceStub, tokens: list[int], timeout: float = 60.0) -> float:
    """Seconds until B's copy holds all of `tokens` (bounded poll)."""
    t0 = time.perf_counter()
    async with asyncio.timeout(timeout):
        while not await b_holds(stub, tokens):
            await asyncio.sleep(0.005)
    return time.perf_counter() - t0


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, object]:
    started: list[ServiceProcess] = []
    cm_a = start_service("cache-manager", tmp / "a", *CM_FLAGS, "--zone", "a")
    started.append(cm_a)
    link = ProxyProcess(cm_a.address, args.delay_ms)
    try:
        cm_b = start_service("cache-manager", tmp / "b", *CM_FLAGS, "--zone", "b", "--follow-zone", f"a={link.address}")
        started.append(cm_b)
        async with grpc.aio.insecure_channel(cm_a.address) as ch_a, grpc.aio.insecure_channel(cm_b.address) as ch_b:
            b = cm_grpc.CacheManagerServiceStub(ch_b)
            pub = Publisher(cm_grpc.CacheManagerServiceStub(ch_a), args.blocks_per_batch)
            await pub.start()
            n = int(args.duration * args.batches_per_s)
            missed = int(args.partition_s * args.batches_per_s)
            cut_at = (n - missed) // 2 if args.partition_s else -1
            heal_at = cut_at + missed if args.partition_s else -1
            partition: dict[str, object] = {}
            before: dict[str, list[tuple[dict[str, str], float]]] = {}
            t0 = time.perf_counter()
            for i in range(n):
                if i == cut_at:
                    await wait_for(b, pub.tokens)
                    before = scrape(cm_a.http_port)
                    link.cut()
                if i == heal_at:
                    link.heal()
                    partition["catch_up_ms"] = round(await wait_for(b, pub.tokens) * 1e3, 1)  # publishing waits
                await pub.batch()
                delay = t0 + (i + 1) / args.batches_per_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            await wait_for(b, pub.tokens)
            await pub.close()
            after = scrape(cm_a.http_port)
            if args.partition_s:
                for key, name, part in (
                    ("resumed_streams", "kvmesh_cache_watch_streams_total", {"start": "resumed"}),
                    ("snapshot_streams", "kvmesh_cache_watch_streams_total", {"start": "snapshot"}),
                    ("resumed_deltas", "kvmesh_cache_watch_deltas_sent_total", {"part": "resumed"}),
                ):
                    partition[key] = int(total(after, name, **part) - total(before, name, **part))
                partition["missed_batches"] = heal_at - cut_at
            lag = lag_ms(scrape(cm_b.http_port))
        return {
            "bench": "zone-follow",
            "delay_ms": args.delay_ms,
            "batches": n,
            "batches_per_s": args.batches_per_s,
            "blocks_per_batch": args.blocks_per_batch,
            "index_lag_ms": lag,
            **({"partition_s": args.partition_s, "partition": partition} if args.partition_s else {}),
        }
    finally:
        link.close()
        for sp in reversed(started):
            sp.terminate(timeout=15)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmesh.bench zone-follow")
    p.add_argument("--delay-ms", type=float, default=1.0, help="one-way delay of the inter-zone link")
    p.add_argument("--batches-per-s", type=float, default=200.0)
    p.add_argument("--blocks-per-batch", type=int, default=4)
    p.add_argument("--duration", type=float, default=10.0, help="seconds of publishing")
    p.add_argument("--partition-s", type=float, default=0.0, help="cut the link this long mid-run (0 = never)")
    args = p.parse_args(argv)
    if args.partition_s >= args.duration:
        p.error("--partition-s must be shorter than --duration")
    with tempfile.TemporaryDirectory(prefix="kvmesh-zone-follow-") as tmp:
        print(json.dumps(asyncio.run(run(args, Path(tmp)))), flush=True)
    return 0
