"""The chaos campaign's processes: the suite (`chaos_suite`), the traffic (`chaos_traffic`), the faults of the
schedule (`chaos_schedule`) carried out at their times, a soak sampler, and the final pass once the last fault
has ended and the traffic has stopped:

* every process SERVING (grpc.health.v1), each waited for at most `FINAL_SERVING_S`;
* each cache-manager's index equals what its workers hold: per worker, the cache-manager's index snapshot
  (CacheManagerService.WatchIndex) holds exactly the index hashes that the cache-manager's own ingest
  (`CacheCore`, with GetStats' block size and model) derives from the worker's full dump
  (WorkerService.StreamKvEvents from sequence 0): what a fresh resync would give; of the blocks whose parent
  the dump lacks (`dump_orphans`) the index may hold at most as many; and each zone's copy of the
  other's index (GetStats' followed_zones) holds as many blocks as that zone's own. Polled until true:
  `index_converged_s` is how long after the traffic stopped (None: not within `CONVERGE_S`);
* no kv-sync lease held and no tier slot left mid-write in any worker's CPU-tier region (attached read-only
  from here, polled until none or `CONVERGE_S`);
* no shared-memory segment (/dev/shm/kvmesh-<pid>-*) of a process of this suite that has exited: counted
  before the teardown (what the restarted workers' orphan clean-up missed) and after it (what a SIGTERM left);
* each cache-manager writes a checkpoint into its store (which the faults filled and restarted).
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import random
import re
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import grpc.aio
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.bench.chaos_schedule import PROCESS_KINDS, Fault
from kvmesh.bench.chaos_suite import (
    PLANNER,
    PLANNER_SERVICE,
    REDIS_PORT,
    Suite,
    all_serving,
    signal_process,
    wait_exit,
)
from kvmesh.bench.chaos_traffic import Traffic
from kvmesh.bench.delay_proxy import ProxyProcess
from kvmesh.bench.process_cpu import stat_fields
from kvmesh.cachemgr.core import CacheCore
from kvmesh.cachemgr.ingest import MASK64
from kvmesh.core.kvevents import BlockStored, KvEvent
from kvmesh.kvplane.kvsync.client import KvSyncClient, PullFailed
from kvmesh.kvplane.kvsync.tier import RegionReader, StaleBlock, slot_data_offset
from kvmesh.suite.shm_leftovers import unlink_unmapped
from kvmesh.v1 import (
    cache_manager_pb2,
    cache_manager_pb2_grpc,
    common_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from kvmesh.wire.proto import events_from_proto

FINAL_SERVING_S = 30.0
CONVERGE_S = 60.0
TERM_EXIT_S = 30.0
OOM_WAIT_S = 10.0  # how long the kernel may take to OOM-kill a worker held below its memory
PULL_BLOCKS = 256  # blocks a fault's own pull asks for
PULL_PROXY_BYTES_PER_S = 256e3  # the slow link of pull_peer_kill: a 256-block pull takes seconds on it
PULL_KILL_AFTER_S = 0.2
LEASE_OVERSHOOT_MIN_S = 0.1  # a lease_expire read at least this long after the lease ended
MEMORY_CGROUP = "/sys/fs/cgroup/memory"  # cgroup v1's memory controller (cgroup v2: /sys/fs/cgroup)
SHM_DIR = "/dev/shm"
_OWNED = re.compile(r"kvmesh-(\d+)-.+")
_DUMP_KINDS = (
    common_pb2.KV_STREAM_KIND_DUMP_BEGIN,
    common_pb2.KV_STREAM_KIND_DUMP_CHUNK,
    common_pb2.KV_STREAM_KIND_DUMP_END,
)


@dataclass
class FaultLog:
    """What one fault did: when it started and ended (campaign seconds) and what happened."""

    fault: Fault
    started: float = 0.0
    ended: float = 0.0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {**self.fault.as_dict(), "started": self.started, "ended": self.ended, "notes": self.notes}


@dataclass
class Sample:
    t: float
    target: str
    pid: int
    rss_mb: float
    fds: int
    threads: int
    tasks: int | None = None  # asyncio tasks, from the process's /metrics (kvmesh_asyncio_tasks); None: unread


class Campaign:
    """Faults and samples over a running suite and its traffic; `t0` is the campaign's zero (monotonic)."""

    def __init__(self, suite: Suite, traffic: Traffic, t0: float) -> None:
        self.suite, self.traffic, self.t0 = suite, traffic, t0
        self.faults: list[FaultLog] = []
        self.samples: list[Sample] = []
        self.drain_violations: list[str] = []
        self.integrity_violations: list[str] = []  # a corrupted block delivered, a full store that "succeeded"
        self.router_counters: dict[tuple[str, int], dict[str, float]] = {}  # (router, pid) -> its last counters
        # every process a suite process started (vLLM's engine core and workers): pid -> (start time, target)
        self.descendants: dict[int, tuple[int, str]] = {}
        self._link_lock = asyncio.Lock()
        # the overlap rule at run time: a restart can outlast the fault's scheduled time, and the next process
        # fault must not start before it (two zones' processes down at once, or two faults racing on one process)
        self._process_lock = asyncio.Lock()

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def _sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, t - self.now()))

    async def run_faults(self, schedule: list[Fault]) -> None:
        """Each fault at its time (they overlap as the schedule says); returns once every one has ended."""
        await asyncio.gather(*(self._at(f) for f in schedule))

    async def _at(self, f: Fault) -> None:
        await self._sleep_until(f.t)
        log = FaultLog(f, started=self.now())
        self.faults.append(log)
        lock = self._process_lock if f.kind in PROCESS_KINDS else contextlib.nullcontext()
        try:
            async with lock:
                if self.now() - log.started > 0.05:
                    log.notes.append(f"waited {self.now() - log.started:.2f}s for the previous process fault's end")
                    log.started = self.now()
                await KINDS[f.kind](self, f, log)
        except Exception as e:  # a fault that could not be carried out is reported, never the campaign's end
            log.notes.append(f"fault failed: {type(e).__name__}: {str(e)[:300]}")
        log.ended = self.now()

    # ---- process faults -------------------------------------------------------------------------------------
    async def _restart(self, target: str, log: FaultLog) -> None:
        t = self.now()
        await asyncio.to_thread(self.suite.start, target)
        log.notes.append(f"restarted in {self.now() - t:.2f}s (pid {self.suite.procs[target].proc.pid})")

    async def kill(self, f: Fault, log: FaultLog) -> None:
        signal_process(self.suite, f.target, signal.SIGKILL)
        await self._killed_then_restarted(f, log)

    async def _killed_then_restarted(self, f: Fault, log: FaultLog) -> None:
        """After a SIGKILL sent to the target: its exit noted, then its restart at the fault's end."""
        code = await asyncio.to_thread(wait_exit, self.suite, f.target, 10.0)
        log.notes.append(f"killed (exit {code})")
        await self._sleep_until(log.started + f.duration_s)
        await self._restart(f.target, log)

    async def stop(self, f: Fault, log: FaultLog) -> None:
        signal_process(self.suite, f.target, signal.SIGSTOP)
        await self._sleep_until(log.started + f.duration_s)
        signal_process(self.suite, f.target, signal.SIGCONT)
        log.notes.append("continued")

    async def term(self, f: Fault, log: FaultLog) -> None:
        await self._graceful_stop(f.target, log)
        await self._restart(f.target, log)

    async def _graceful_stop(self, target: str, log: FaultLog) -> None:
        """SIGTERM, its exit waited for (SIGKILL after TERM_EXIT_S) and noted with how long it took."""
        t = self.now()
        signal_process(self.suite, target, signal.SIGTERM)
        code = await asyncio.to_thread(wait_exit, self.suite, target, TERM_EXIT_S)
        if code is None:
            log.notes.append(f"did not exit within {TERM_EXIT_S}s of SIGTERM: killed")
            signal_process(self.suite, target, signal.SIGKILL)
            code = await asyncio.to_thread(wait_exit, self.suite, target, 10.0)
        log.notes.append(f"exited {code} after {self.now() - t:.2f}s")

    async def version_skew(self, f: Fault, log: FaultLog) -> None:
        """The worker comes back as another build (its version label) under the same id and address, while
        the routers still hold its old view; then it is rolled back the same way."""
        await self._graceful_stop(f.target, log)
        t = self.now()
        await asyncio.to_thread(self.suite.start, f.target, ("--version", str(f.params["version"])))
        log.notes.append(f"back as version {f.params['version']} in {self.now() - t:.2f}s")
        await self._sleep_until(log.started + f.duration_s)
        await self._graceful_stop(f.target, log)
        await self._restart(f.target, log)

    async def oom_kill(self, f: Fault, log: FaultLog) -> None:
        """The worker moved into a memory cgroup of its own whose limit is 1 MiB above nothing charged yet
        (cgroup v1 charges only what it allocates from now on), and sent long prompts: its next allocations
        exceed the limit and the kernel's OOM killer sends SIGKILL. Where no memory cgroup can be made, or the
        kernel has not killed it within OOM_WAIT_S, SIGKILL by hand (noted: the signal the OOM killer sends)."""
        pid = self.suite.procs[f.target].proc.pid
        group = os.path.join(MEMORY_CGROUP, f"kvmesh-chaos-{pid}")
        try:
            os.mkdir(group)
            with open(os.path.join(group, "memory.limit_in_bytes"), "w") as fh:
                fh.write(str(1 << 20))
            with open(os.path.join(group, "cgroup.procs"), "w") as fh:
                fh.write(str(pid))
        except OSError as e:
            log.notes.append(f"no memory cgroup ({e.strerror}): SIGKILL as the OOM killer sends it")
            signal_process(self.suite, f.target, signal.SIGKILL)
        dead = asyncio.Event()  # long prompts straight to it meanwhile: an idle process allocates little
        load = asyncio.create_task(self.traffic.fill(f.target, self.now() + OOM_WAIT_S, dead))
        code = await asyncio.to_thread(wait_exit, self.suite, f.target, OOM_WAIT_S)
        dead.set()
        log.notes.append(f"{await load} long prompts sent to it meanwhile")
        if code is None:
            log.notes.append(f"not OOM-killed within {OOM_WAIT_S}s: SIGKILL")
            signal_process(self.suite, f.target, signal.SIGKILL)
            code = await asyncio.to_thread(wait_exit, self.suite, f.target, 10.0)
        with contextlib.suppress(OSError):
            kills = [ln for ln in open(os.path.join(group, "memory.oom_control")) if ln.startswith("oom_kill ")]  # noqa: SIM115
            log.notes.append(f"exit {code}, kernel {kills[0].strip() if kills else 'oom_kill ?'}")
        await asyncio.to_thread(_remove_cgroup, group)
        await self._sleep_until(log.started + f.duration_s)
        await self._restart(f.target, log)

    async def pull_peer_kill(self, f: Fault, log: FaultLog) -> None:
        """A pull of the worker's tier blocks over gRPC through a proxy capped at `PULL_PROXY_BYTES_PER_S` (a
        slow link: the bytes take a while), the worker SIGKILLed once the lease is granted and the stream has
        begun; the pull must fail closed (PullFailed) with only whole, verified blocks delivered (the client's
        checks), or have completed before the kill (noted). Restarted after the fault's time."""
        info = await _tier_of(self.suite.address(f.target))
        blocks = await asyncio.to_thread(_published, info.tier_shm_name, PULL_BLOCKS) if info.tier_shm_name else []
        if not blocks:
            log.notes.append("no published block in the tier: killed without a pull")
            await self.kill(f, log)
            return
        proxy = await asyncio.to_thread(ProxyProcess, info.kvsync_address, 0.0, "127.0.0.1", PULL_PROXY_BYTES_PER_S)
        try:
            async with grpc.aio.insecure_channel(proxy.address) as ch:
                client = KvSyncClient(ch)
                region = await client.describe(info.tier_region)
                outs = [memoryview(bytearray(region.block_bytes)) for _ in blocks]
                lease = await client.acquire_lease(info.tier_region, blocks, ttl_ms=10_000)
                pull = asyncio.create_task(
                    client.pull(
                        info.tier_region,
                        blocks,
                        outs,
                        region.layout,
                        lease=lease,
                        timeout_s=10,
                        prefer_shm=False,
                        transport="grpc",
                    )
                )
                await asyncio.sleep(PULL_KILL_AFTER_S)  # the fault's own timing: the stream is under way
                signal_process(self.suite, f.target, signal.SIGKILL)
                try:
                    stats = await pull
                    log.notes.append(f"the pull of {len(blocks)} blocks completed before the kill")
                except PullFailed as e:
                    log.notes.append(f"pull failed closed ({e.reason}) after {e.blocks} of {len(blocks)} blocks")
                    stats = e.delivered
            if stats.blocks > len(blocks):
                self.integrity_violations.append(f"t={self.now():.2f} {f.target}: more blocks than asked")
        finally:
            await asyncio.to_thread(proxy.close)
        await self._killed_then_restarted(f, log)

    # ---- the inter-zone link --------------------------------------------------------------------------------
    def _proxies(self) -> list[Any]:
        links = self.suite.links
        assert links is not None
        return [*links.cm.values(), *links.kvsync.values()]

    async def link_cut(self, f: Fault, log: FaultLog) -> None:
        async with self._link_lock:
            assert self.suite.links is not None
            await asyncio.to_thread(self.suite.links.cut)
            await self._sleep_until(log.started + f.duration_s)
            await asyncio.to_thread(self.suite.links.heal)

    async def _switch_link(self, f: Fault, log: FaultLog, attr: str, value: float) -> None:
        """Every proxy of the link restarted with `attr` set to `value` (its connections die at the switch),
        then, after the fault's time, as before."""
        async with self._link_lock:
            proxies = self._proxies()
            before = getattr(proxies[0], attr)

            def switch(v: float) -> None:
                for p in proxies:
                    setattr(p, attr, v)
                    p.cut()
                    p.heal()

            await asyncio.to_thread(switch, value)
            await self._sleep_until(log.started + f.duration_s)
            await asyncio.to_thread(switch, before)

    async def link_delay(self, f: Fault, log: FaultLog) -> None:
        await self._switch_link(f, log, "delay_ms", float(f.params["delay_ms"]))

    async def link_cap(self, f: Fault, log: FaultLog) -> None:
        await self._switch_link(f, log, "rate", float(f.params["bytes_per_s"]))

    async def link_flap(self, f: Fault, log: FaultLog) -> None:
        async with self._link_lock:
            links = self.suite.links
            assert links is not None
            half = float(f.params["period_s"]) / 2
            flaps = 0
            while self.now() < log.started + f.duration_s:
                await asyncio.to_thread(links.cut)
                await asyncio.sleep(half)  # the flap's own rhythm
                await asyncio.to_thread(links.heal)
                await asyncio.sleep(half)
                flaps += 1
            log.notes.append(f"{flaps} flaps")

    # ---- the rogue planner ------------------------------------------------------------------------------------
    async def rogue_drain(self, f: Fault, log: FaultLog) -> None:
        """DrainWorker of every worker of the zone's router with the planner's identity: whatever it lets
        through must leave the zone its floor; each refusal must be PERMISSION_DENIED naming drain_floor
        (`drain_violations` otherwise). Undrained after the fault's time."""
        zone = f.target
        md = (("authorization", f"Bearer {self.suite.tokens[PLANNER.id]}"),)
        address = self.suite.address(f"{zone}/router")
        drained: list[str] = []
        async with grpc.aio.insecure_channel(address) as ch:
            stub = router_pb2_grpc.RouterAdminServiceStub(ch)
            try:
                listed = await stub.ListWorkers(router_pb2.ListWorkersRequest(), metadata=md, timeout=5)
            except grpc.aio.AioRpcError as e:
                log.notes.append(f"router unreachable ({e.code().name}): nothing drained")
                return
            ids = [w.endpoint.id for w in listed.workers if w.endpoint.id]  # a worker not met yet has none
            routable = sum(1 for w in listed.workers if not w.draining and w.circuit != "open")
            refused = 0
            for wid in ids:
                try:
                    await stub.DrainWorker(
                        router_pb2.DrainWorkerRequest(worker_id=wid, drain=True), metadata=md, timeout=5
                    )
                    drained.append(wid)
                    log.notes.append(f"drained {wid}")
                except grpc.aio.AioRpcError as e:
                    log.notes.append(f"refused {wid}: {e.code().name} {e.details()[:160]}")
                    if e.code() == grpc.StatusCode.PERMISSION_DENIED and "drain_floor" in (e.details() or ""):
                        refused += 1
                    elif e.code() != grpc.StatusCode.UNAVAILABLE:
                        self.drain_violations.append(f"t={self.now():.2f} {zone}: {wid} refused with {e.code().name}")
            if ids and refused == 0:
                self.drain_violations.append(
                    f"t={self.now():.2f} {zone}: the planner drained {len(drained)} of {len(ids)} workers "
                    f"({routable} routable before) and no drain was refused by drain_floor"
                )
            await self._sleep_until(log.started + f.duration_s)
            for wid in drained:
                try:
                    await stub.DrainWorker(
                        router_pb2.DrainWorkerRequest(worker_id=wid, drain=False), metadata=md, timeout=5
                    )
                except grpc.aio.AioRpcError as e:
                    log.notes.append(f"undrain {wid}: {e.code().name} (a restarted router forgot the drain)")

    # ---- stores -------------------------------------------------------------------------------------------------
    async def checkpoint_full(self, f: Fault, log: FaultLog) -> None:
        """The zone's checkpoint store full: Redis held at its memory limit with no eviction, or the tmpfs of
        the checkpoint files filled to ENOSPC. A checkpoint asked for meanwhile must fail with a clear code
        (the store's error named, the cache-manager serving on); after the fault, `final_pass` checks that a
        checkpoint succeeds again."""
        zone = f.target
        address = self.suite.address(f"{zone}/cache-manager")
        if zone == self.suite.redis_zone():
            client = redis.Redis(host=self.suite.zone(zone).ns_ip, port=REDIS_PORT, socket_timeout=2)
            try:
                used = int((await asyncio.to_thread(client.info, "memory"))["used_memory"])
                await asyncio.to_thread(client.config_set, "maxmemory-policy", "noeviction")
                await asyncio.to_thread(client.config_set, "maxmemory", str(max(1, used // 2)))
            except redis.RedisError as e:
                log.notes.append(f"redis unreachable ({type(e).__name__}): nothing filled")
                return
            log.notes.append(f"redis maxmemory {used // 2} (used {used})")
            try:
                await self._checkpoint_while_full(address, log)
                await self._sleep_until(log.started + f.duration_s)
            finally:
                with contextlib.suppress(redis.RedisError):
                    await asyncio.to_thread(client.config_set, "maxmemory", "0")
            return
        filler = self.suite.checkpoint_dirs[zone] / "chaos-filler"
        written = await asyncio.to_thread(_fill, filler)
        log.notes.append(f"tmpfs filled ({written} bytes)")
        try:
            await self._checkpoint_while_full(address, log)
            await self._sleep_until(log.started + f.duration_s)
        finally:
            filler.unlink(missing_ok=True)

    async def _checkpoint_while_full(self, address: str, log: FaultLog) -> None:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = cache_manager_pb2_grpc.CacheManagerServiceStub(ch)
            try:
                await stub.Checkpoint(cache_manager_pb2.CheckpointRequest(), timeout=10)
            except grpc.aio.AioRpcError as e:
                log.notes.append(f"checkpoint refused: {e.code().name} {(e.details() or '')[:160]}")
                if e.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
                    self.integrity_violations.append(f"t={self.now():.2f} {address}: a full store gave {e.code().name}")
                return
        self.integrity_violations.append(f"t={self.now():.2f} {address}: a checkpoint succeeded into a full store")

    async def tier_corrupt(self, f: Fault, log: FaultLog) -> None:
        """One byte of a published block in the worker's CPU tier flipped in its shared memory (its header
        and CRC32C unchanged, as a bit flip in DRAM would leave them); then a kv-sync pull of that block from
        the worker, as a peer would make it, must fail its integrity check (`integrity_violations`
        otherwise). A block evicted or rewritten in between is noted, not counted."""
        info = await _tier_of(self.suite.address(f.target))
        if not info.tier_shm_name:
            log.notes.append("no CPU tier: nothing corrupted")
            return
        picked = await asyncio.to_thread(_flip_a_byte, info.tier_shm_name, random.Random(f"{f.t}/{f.target}"))
        if picked is None:
            log.notes.append("no published block in the tier: nothing corrupted")
            return
        digest, slot, generation = picked
        log.notes.append(f"flipped a byte of slot {slot} (block {digest.hex()[:16]})")
        async with grpc.aio.insecure_channel(info.kvsync_address) as ch:
            client = KvSyncClient(ch)
            try:
                region = await client.describe(info.tier_region)
                out = memoryview(bytearray(region.block_bytes))
                stats = await client.pull(info.tier_region, [digest], [out], region.layout, timeout_s=5)
            except PullFailed as e:
                log.notes.append(f"pull failed closed: {e.reason}")
                return
            except grpc.aio.AioRpcError as e:
                log.notes.append(f"kv-sync unreachable: {e.code().name}")
                return
        reader = RegionReader.attach(info.tier_shm_name)
        try:
            rewritten = reader.generation(slot) != generation
        finally:
            reader.close()
        if stats.blocks and not rewritten:
            self.integrity_violations.append(f"t={self.now():.2f} {f.target}: a corrupted block was delivered")
        log.notes.append(f"pull delivered {stats.blocks} blocks ({'slot rewritten' if rewritten else 'not found'})")

    async def lease_expire(self, f: Fault, log: FaultLog) -> None:
        """A lease of `params["ttl_ms"]` on the worker's blocks, its puller stalled past the lease's end (by the
        fault's time less the ttl) while the worker serves on, then the read: it must be refused as expired,
        never copy blocks the worker was free to evict or rewrite (`integrity_violations` otherwise). The stall
        counts from the lease's end on the worker's clock (`lease_until_ns`, CLOCK_MONOTONIC: every process of
        the suite shares the host), not from the fault's start: a slow Describe or AcquireLease on a loaded
        worker would otherwise eat the overshoot and a read inside the lease pass for one past it."""
        info = await _tier_of(self.suite.address(f.target))
        blocks = await asyncio.to_thread(_published, info.tier_shm_name, PULL_BLOCKS) if info.tier_shm_name else []
        if not blocks:
            log.notes.append("no published block in the tier: nothing leased")
            return
        ttl_ms = int(f.params["ttl_ms"])
        async with grpc.aio.insecure_channel(info.kvsync_address) as ch:
            client = KvSyncClient(ch)
            region = await client.describe(info.tier_region)
            outs = [memoryview(bytearray(region.block_bytes)) for _ in blocks]
            lease = await client.acquire_lease(info.tier_region, blocks, ttl_ms=ttl_ms)
            overshoot_s = max(f.duration_s - ttl_ms / 1000, LEASE_OVERSHOOT_MIN_S)
            await asyncio.sleep((lease.lease_until_ns - time.monotonic_ns()) / 1e9 + overshoot_s)  # the stall
            read_at_ns = time.monotonic_ns()
            try:
                stats = await client.pull(info.tier_region, blocks, outs, region.layout, lease=lease, timeout_s=5)
            except PullFailed as e:
                log.notes.append(f"read after the lease refused: {e.reason}")
                if e.blocks:
                    self.integrity_violations.append(
                        f"t={self.now():.2f} {f.target}: {e.blocks} blocks copied after their lease ended"
                    )
                return
        late_s = (read_at_ns - lease.lease_until_ns) / 1e9
        self.integrity_violations.append(
            f"t={self.now():.2f} {f.target}: a read {late_s:.2f} s past the end of a {ttl_ms} ms lease delivered "
            f"{stats.blocks} blocks over {stats.transport}"
        )

    # ---- load ----------------------------------------------------------------------------------------------------
    async def pool_full(self, f: Fault, log: FaultLog) -> None:
        sent = await self.traffic.fill(f.target, log.started + f.duration_s)
        log.notes.append(f"{sent} long sessions sent")

    async def burst(self, f: Fault, log: FaultLog) -> None:
        self.traffic.rate_factor = float(f.params["factor"])
        await self._sleep_until(log.started + f.duration_s)
        self.traffic.rate_factor = 1.0

    # ---- soak sampling -------------------------------------------------------------------------------------------
    async def sample_every(self, every_s: float, until: float) -> None:
        """Each process's RSS, fds and threads from /proc and its asyncio tasks from its /metrics (`samples`),
        and each router's prefill/decode counters (`router_counters`), every `every_s`."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
            while self.now() < until:
                for target, sp in list(self.suite.procs.items()):
                    s = proc_sample(sp.proc.pid)
                    if s is None:
                        continue
                    for pid in descendants(sp.proc.pid):
                        started = start_ticks(pid)
                        if started is not None:
                            self.descendants.setdefault(pid, (started, target))
                    families: dict[str, float] = {}
                    if not target.endswith("/redis"):
                        with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError, ValueError):
                            host = sp.address.rsplit(":", 1)[0]
                            async with http.get(f"http://{host}:{sp.http_port}/metrics") as resp:
                                text = await resp.text()
                            families = scalar_metrics(text, ("kvmesh_asyncio_tasks",))
                            if target.endswith("/router"):
                                self.router_counters[(target, sp.proc.pid)] = pd_counters(text)
                    tasks = families.get("kvmesh_asyncio_tasks")
                    self.samples.append(
                        Sample(round(self.now(), 2), target, sp.proc.pid, *s, None if tasks is None else int(tasks))
                    )
                await asyncio.sleep(every_s)  # the sampling period

    def orphans(self) -> list[str]:
        """The processes a suite process started that outlived it (re-parented away from every suite process
        and its descendants): what a killed service left running. Checked before the teardown."""
        live = {sp.proc.pid for sp in self.suite.procs.values() if sp.proc.poll() is None}
        mine = {pid for pid, (t, _) in self.descendants.items() if start_ticks(pid) == t}
        return [
            f"{target}: pid {pid} ({_comm(pid)})"
            for pid, (_t, target) in sorted(self.descendants.items())
            if pid in mine and _ppid(pid) not in live | mine
        ]

    def pd_totals(self) -> dict[str, float]:
        """The routers' prefill/decode counters summed over every router process of the run, each at its last
        sample (a process's counts after its last sample are not seen: a floor, not the exact total)."""
        out: dict[str, float] = {}
        for counters in self.router_counters.values():
            for k, v in counters.items():
                out[k] = out.get(k, 0.0) + v
        return dict(sorted(out.items()))


KINDS: dict[str, Callable[[Campaign, Fault, FaultLog], Awaitable[None]]] = {
    "kill": Campaign.kill,
    "stop": Campaign.stop,
    "term": Campaign.term,
    "version_skew": Campaign.version_skew,
    "oom_kill": Campaign.oom_kill,
    "link_cut": Campaign.link_cut,
    "link_delay": Campaign.link_delay,
    "link_cap": Campaign.link_cap,
    "link_flap": Campaign.link_flap,
    "rogue_drain": Campaign.rogue_drain,
    "pool_full": Campaign.pool_full,
    "checkpoint_full": Campaign.checkpoint_full,
    "tier_corrupt": Campaign.tier_corrupt,
    "pull_peer_kill": Campaign.pull_peer_kill,
    "lease_expire": Campaign.lease_expire,
    "burst": Campaign.burst,
}


async def _tier_of(address: str) -> worker_pb2.GetInfoResponse:
    async with grpc.aio.insecure_channel(address) as ch:
        return await worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)


def _published(shm_name: str, most: int) -> list[bytes]:
    """Digests of up to `most` blocks published in the region, in slot order."""
    reader = RegionReader.attach(shm_name)
    try:
        return [digest for digest, _ref in reader.published()[:most]]
    finally:
        reader.close()


def _remove_cgroup(group: str) -> None:
    """rmdir of an emptied memory cgroup (its charges go to the parent); retried while the dead process's
    exit is still being accounted."""
    deadline = time.monotonic() + 5
    while True:
        try:
            os.rmdir(group)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)  # the kernel finishing the exit


def _fill(path: Any) -> int:
    """Writes zeros to `path` until its filesystem is full (ENOSPC); the bytes written."""
    written = 0
    chunk = bytes(1 << 20)
    with open(path, "wb", buffering=0) as fh:
        while True:
            try:
                written += fh.write(chunk)
            except OSError:
                break
        with contextlib.suppress(OSError):  # the last bytes that fit, to a byte
            while True:
                n = fh.write(b"\0" * 4096)
                if not n:
                    break
                written += n
    return written


def _flip_a_byte(shm_name: str, rng: random.Random) -> tuple[bytes, int, int] | None:
    """Flips one data byte of a random published block in the region (header and CRC left as they are):
    (its digest, slot, generation), or None when no block is published."""
    reader = RegionReader.attach(shm_name)
    try:
        published = reader.published()
        if not published:
            return None
        digest, ref = rng.choice(published)
        slot, generation = ref.slot, ref.generation
        try:
            length = len(reader.view(ref, digest)[0])
        except StaleBlock:  # rewritten since the scan: another fault's time
            return None
        offset = slot_data_offset(reader.block_bytes, reader.num_slots, slot) + rng.randrange(max(1, length))
    finally:
        reader.close()
    with open(os.path.join(SHM_DIR, shm_name), "r+b") as fh, mmap.mmap(fh.fileno(), 0) as m:
        m[offset] ^= 0xFF
    return digest, slot, generation


PD_COUNTERS = ("kvmesh_pd_decisions_total", "kvmesh_handoff_blocks_total", "kvmesh_handoff_fallbacks_total")


def scalar_metrics(text: str, names: Sequence[str]) -> dict[str, float]:
    """The values of unlabelled gauges `names` in a /metrics exposition (NaN ones left out)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names and not sample.labels and sample.value == sample.value:
                out[sample.name] = sample.value
    return out


def pd_counters(text: str) -> dict[str, float]:
    """From a router's /metrics: its disaggregated and aggregated decisions, handed-over blocks and fallbacks
    by cause (``disaggregated``, ``aggregated``, ``handoff_blocks``, ``fallback_<cause>``)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_total") or family.name + "_total" not in PD_COUNTERS:
                continue
            if sample.name == "kvmesh_pd_decisions_total":
                key = sample.labels.get("mode", "")
            elif sample.name == "kvmesh_handoff_blocks_total":
                key = "handoff_blocks"
            else:
                key = f"fallback_{sample.labels.get('cause', '')}"
            out[key] = out.get(key, 0.0) + sample.value
    return out


def proc_sample(pid: int) -> tuple[float, int, int] | None:
    """(RSS MiB, open fds, threads) of a live process, from /proc; None when it is gone."""
    try:
        status = open(f"/proc/{pid}/status").read()  # noqa: SIM115 - read at once
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("State", "").strip().startswith("Z"):
        return None
    rss_kb = int(fields.get("VmRSS", "0 kB").split()[0])
    return round(rss_kb / 1024, 2), fds, int(fields.get("Threads", "0"))


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (its children, theirs, ...), from /proc."""
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError), open(f"/proc/{p}/task/{tid}/children") as fh:
                kids = [int(x) for x in fh.read().split()]
                out += kids
                todo += kids
    return out


def kill_descendants(known: dict[int, tuple[int, str]]) -> None:
    """SIGKILL each recorded descendant still running (the same process: same pid and start time)."""
    for pid, (started, _target) in known.items():
        if start_ticks(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first); None when gone or a zombie."""
    fields = stat_fields(pid)
    return None if fields is None or fields[0] == "Z" else fields


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with the pid, names one process, not a reused pid."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def _ppid(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[1]) if fields else 0


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as fh:
            return fh.read().strip()
    except OSError:
        return "?"


# ---- the final pass --------------------------------------------------------------------------------------------
async def worker_dump(address: str) -> tuple[str, list[KvEvent], str]:
    """(worker id, the events of its full dump, its CPU-tier region's shm name)."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
        events: list[KvEvent] = []
        call = stub.StreamKvEvents(worker_pb2.StreamKvEventsRequest(start_sequence=0), timeout=10)
        async for m in call:
            if m.kind in _DUMP_KINDS:
                events.extend(events_from_proto(m.batch))
            if m.kind == common_pb2.KV_STREAM_KIND_DUMP_END:
                call.cancel()
                break
        return info.worker_id, events, info.tier_shm_name


@dataclass
class DumpIndex:
    """What a cache-manager's own ingest (`CacheCore`) derives from one worker's full dump."""

    indexed: set[int]  # index hashes of the dump's blocks whose chain the dump holds
    orphans: set[int]  # engine hashes of blocks whose parent the dump lacks (nor any ancestor's chain)


def indexed_from_dump(worker_id: str, events: Sequence[KvEvent], block_size: int, model: str) -> DumpIndex:
    """The dump's blocks as the cache-manager indexes them. An engine may keep a child whose parent it
    evicted: live ingestion chains it through the parent's tombstone, but a dump has no parent to chain it to
    (`orphans`: a cache-manager that refuses the whole dump for them never resyncs that worker); the rest is
    ingested as a resync would."""
    known: set[int] = set()
    orphans: set[int] = set()
    chained: list[KvEvent] = []
    for ev in events:  # parents first, as the worker sends them
        if isinstance(ev, BlockStored):
            if ev.parent_block_hash is not None and ev.parent_block_hash & MASK64 not in known:
                orphans.update(h & MASK64 for h in ev.block_hashes)
                continue
            known.update(h & MASK64 for h in ev.block_hashes)
        chained.append(ev)
    core = CacheCore(block_size, model)
    core.begin_dump(worker_id, "")
    core.apply_dump(worker_id, chained)
    core.end_dump(worker_id, 1)
    return DumpIndex({int(h) for h in core.index.blocks_of(worker_id)}, orphans - known)


async def index_blocks(address: str) -> tuple[dict[str, set[int]], cache_manager_pb2.GetStatsResponse]:
    """The cache-manager's index snapshot (worker -> distinct index hashes) and its stats."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = cache_manager_pb2_grpc.CacheManagerServiceStub(ch)
        per: dict[str, set[int]] = {}
        call = stub.WatchIndex(cache_manager_pb2.WatchIndexRequest(), timeout=10)
        async for m in call:
            for d in m.deltas:
                held = per.setdefault(d.worker_id, set())
                if d.cleared:
                    held.clear()
                held.update(d.stored)
                held.difference_update(d.removed)
            if m.snapshot_done or not m.snapshot:
                call.cancel()
                break
        stats = await stub.GetStats(cache_manager_pb2.GetStatsRequest(), timeout=5)
        return per, stats


async def index_differences(suite: Suite) -> tuple[list[str], list[str]]:
    """(what differs between each cache-manager's index and its workers, and between the zones' copies; per
    worker whose full dump holds blocks without their parent, how many)."""
    diffs: list[str] = []
    orphaned: list[str] = []
    own_blocks: dict[str, int] = {}
    followed: dict[str, dict[str, int]] = {}
    for z in suite.zones:
        per, stats = await index_blocks(suite.address(f"{z.name}/cache-manager"))
        own_blocks[z.name] = stats.blocks
        followed[z.name] = {fz.zone: fz.blocks for fz in stats.followed_zones}
        for target in suite.workers(z.name):
            wid, events, _shm = await worker_dump(suite.address(target))
            held = per.get(wid, set())
            dump = indexed_from_dump(wid, events, stats.block_size, stats.model)
            if dump.orphans:
                orphaned.append(f"{z.name}: {wid}'s dump holds {len(dump.orphans)} blocks whose parent it lacks")
            # exact on the chained blocks; orphans the index holds (chained live, through tombstones) by count
            missing, extra = dump.indexed - held, held - dump.indexed
            if missing or len(extra) > len(dump.orphans):
                diffs.append(
                    f"{z.name}: index of {wid} holds {len(held)} blocks, its dump {len(dump.indexed)} chained + "
                    f"{len(dump.orphans)} orphaned: {len(missing)} missing, {len(extra)} not in the chained dump"
                )
    for follower, others in followed.items():
        for other, blocks in others.items():
            if blocks != own_blocks.get(other):
                diffs.append(f"{follower} follows {other} with {blocks} blocks, {other} holds {own_blocks.get(other)}")
    return diffs, orphaned


async def held_slots(suite: Suite) -> tuple[int, int]:
    """(leases held past now, slots left mid-write) over every worker's CPU-tier region."""
    leases = slots = 0
    for z in suite.zones:
        for target in suite.workers(z.name):
            _wid, _events, shm = await worker_dump(suite.address(target))
            if not shm:
                continue
            reader = RegionReader.attach(shm)
            try:
                now = time.monotonic_ns()  # the lessor's clock: CLOCK_MONOTONIC is the host's
                leases += sum(1 for s in range(reader.num_slots) if reader.lease_until(s) > now)
                slots += reader.writes_under_way()  # a write begun, never published
            finally:
                reader.close()
    return leases, slots


async def converge(
    check: Callable[[], Awaitable[Any]], done: Callable[[Any], bool], timeout_s: float
) -> tuple[float | None, Any]:
    """Polls `check` every 0.5 s until `done(result)`: (seconds it took or None, the last result)."""
    t0 = time.monotonic()
    last: Any = None
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError):
            last = await check()
            if done(last):
                return round(time.monotonic() - t0, 2), last
        if time.monotonic() - t0 > timeout_s:
            return None, last
        await asyncio.sleep(0.5)  # the poll's interval


async def routable_workers(suite: Suite, zone: str) -> int:
    """How many workers the zone's router knows by id and would route to (the planner's view)."""
    md = (("authorization", f"Bearer {suite.tokens[PLANNER_SERVICE.id]}"),)
    async with grpc.aio.insecure_channel(suite.address(f"{zone}/router")) as ch:
        listed = await router_pb2_grpc.RouterAdminServiceStub(ch).ListWorkers(
            router_pb2.ListWorkersRequest(), metadata=md, timeout=5
        )
    return sum(1 for w in listed.workers if w.endpoint.id and not w.draining and w.circuit != "open")


async def routers_ready(suite: Suite, timeout_s: float) -> None:
    """Waits until every zone's router routes to all its workers (a vLLM worker serves gRPC before its router
    has met it: traffic sent before would only meet "no worker available"); raises after `timeout_s`."""
    for z in suite.zones:
        want = len(suite.workers(z.name))

        async def seen_by_router(zone: str = z.name) -> int:
            return await routable_workers(suite, zone)

        took, seen = await converge(seen_by_router, want.__eq__, timeout_s)
        if took is None:
            raise RuntimeError(f"router of zone {z.name} routes to {seen} of {want} workers after {timeout_s}s")


def shm_of(pids: set[int]) -> list[str]:
    """kvmesh-<pid>-* segments in /dev/shm owned by one of `pids` that has exited."""
    out = []
    for name in os.listdir(SHM_DIR) if os.path.isdir(SHM_DIR) else ():
        m = _OWNED.fullmatch(name)
        if m and int(m.group(1)) in pids and not os.path.exists(f"/proc/{m.group(1)}"):
            out.append(name)
    return sorted(out)


def remove_shm(names: list[str]) -> None:
    """Unlinks the leftovers once counted, so that the campaign leaves the host as it found it."""
    unlink_unmapped([os.path.join(SHM_DIR, n) for n in names])


async def checkpoint_errors(suite: Suite) -> list[str]:
    """A checkpoint asked of each cache-manager (after the last fault, its store back to normal): what failed."""
    errors = []
    for z in suite.zones:
        async with grpc.aio.insecure_channel(suite.address(f"{z.name}/cache-manager")) as ch:
            stub = cache_manager_pb2_grpc.CacheManagerServiceStub(ch)
            try:
                await stub.Checkpoint(cache_manager_pb2.CheckpointRequest(), timeout=10)
            except grpc.aio.AioRpcError as e:
                errors.append(f"{z.name}: {e.code().name} {(e.details() or '')[:200]}")
    return errors


async def final_pass(suite: Suite) -> dict[str, Any]:
    health = await all_serving(suite, FINAL_SERVING_S)
    converged_s, found = await converge(lambda: index_differences(suite), lambda d: not d[0], CONVERGE_S)
    diffs, orphaned = found if found is not None else ([], [])
    _t, held = await converge(lambda: held_slots(suite), lambda h: h == (0, 0), CONVERGE_S)
    leases, slots = held if held is not None else (-1, -1)
    return {
        "not_serving": {t: why for t, why in health.items() if why},
        "index_converged_s": converged_s,
        "index_differences": diffs,
        "dump_orphans": orphaned,
        "leases": leases,
        "slots": slots,
        "shm_before_teardown": shm_of(suite.pids),
        "checkpoint_errors": await checkpoint_errors(suite),
    }
