"""``python -m kvmesh.bench failover --zones 2 --workers-per-zone 2 --duration 60 [--scenario zone]
[--replication on|off]``.

Each zone runs in its own network namespace (`kvmesh.bench.netns`): cache-manager, simulated workers,
router and failover service, all real processes; Consul is the test STAND-IN (``python -m
tests.consul_standin``) in the root namespace, or a real agent with ``--consul-url``. The zones talk to
each other only through the emulated inter-zone link (`kvmesh.bench.zone_link`: `--link-delay-ms` each
way, `--link-rate` bytes/s): each cache-manager follows the others' indexes and, with ``--replication on``,
replicates its hot prefixes into their workers' CPU tiers. `--clients` sessions (each a
`kvmesh.client.AsyncClient` following the failover services, its own zone's first: client i belongs to
zone i mod zones) send turns one after another, `--think-s` apart: a system prompt all share, the
session's own long context (`--context-tokens` in all) and a short new question. Scenarios (times as
fractions of --duration):

* ``zone``: at 25 % zone 0 dies (SIGKILL of all its processes, failover service included, and its
  link cut); at 50 % the link is healed and its processes restarted and registered.
* ``failover``: at 25 % only zone 0's failover service is SIGKILLed; restarted at 50 %.
* ``consul``: Consul is stopped (SIGSTOP) from 15 % for ``--consul-stop-s`` seconds; zone 0 dies at
  25 % while Consul is stopped (endpoint sets are last-known-good); restored after Consul is back.
* ``partition``: at 25 % the inter-zone link is cut for ``--partition-s`` seconds (clients still reach
  both zones), then healed.

Prints one JSON line. ``switchover_s``: per client, ``max(0, last send to zone 0 in [kill,
restore) - kill)`` (the time until that client sends only to other zones), p50 and max over
clients; ``outage_s``: from the kill to the start of the restore; ``requests_lost``: requests that
failed or ended short; ``requests_duplicated``: requests that delivered more tokens than asked;
``failback_s``: from zone 0 restored (serving and registered) to the first request a client sends to it;
``request_s``: p50 and max of a served request's time, first attempt to last token (a request caught on the
dead zone waits for the clients' liveness pings to fail its stream, then resumes elsewhere);
``failback_rewarm_hold_s`` (``--scenario zone|consul``): how long the surviving zone's failover service held the
restored zone at the ramp floor for its re-warm, and why the hold ended (``warm`` or ``timeout``).
Zone figures (`kvmesh.bench.failover_figures`): ``pre_switch_hit_ratio``, ``post_switch_hit_ratio``
(zone 0's sessions, before the kill on zone 0 and in the first 60 s after it elsewhere),
``post_switch_first_hit_ratio``, ``failback_hit_ratio``, ``cross_zone_sync_ms`` (a 32-block batch through
the link under a lease taken inside the peer's zone, as replication pulls; ``cross_zone_sync_unleased_ms``:
leasing through the link too), ``index_lag_ms`` (zone 1 following zone 0) and ``replication_bytes_per_s``
(zone 0, until the kill); ``partition`` adds ``requests_moved`` and the follow / replication counters after the heal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc.aio

import kvmesh
from kvmesh.bench import failover_figures as figures
from kvmesh.bench import netns
from kvmesh.bench.zone_link import InterZoneLinks
from kvmesh.client import AsyncClient
from kvmesh.discovery.model import ServiceInstance
from kvmesh.suite.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, failover_pb2, failover_pb2_grpc, router_pb2

REPO = Path(kvmesh.__file__).resolve().parents[2]
BS = "32"
SYSTEM_TOKENS = 256  # shared by every session
POST_SWITCH_WINDOW_S = 60.0
ROLES = {
    "router": common_pb2.SERVICE_ROLE_ROUTER,
    "worker": common_pb2.SERVICE_ROLE_WORKER,
    "cache-manager": common_pb2.SERVICE_ROLE_CACHE_MANAGER,
}


@dataclass
class ZoneProcs:
    zone: netns.Zone
    procs: list[ServiceProcess] = field(default_factory=list)
    failover: ServiceProcess | None = None


@dataclass
class Stats:
    total: int = 0
    lost: int = 0
    duplicated: int = 0
    errors: list[str] = field(default_factory=list)
    attempts: list[tuple[int, float, str]] = field(default_factory=list)  # (client, t, zone)
    served: list[Served] = field(default_factory=list)


@dataclass(frozen=True)
class Served:
    """A completed request: its session (client), turn, when it ended, the zone that served it, its tokens."""

    client: int
    turn: int
    t: float
    zone: str
    prompt_tokens: int
    cached_tokens: int
    seconds: float  # from the first attempt to the last token


def start_failover(z: netns.Zone, tmp: Path, consul: str, zones: list[str]) -> ServiceProcess:
    return netns.start_in_zone(
        z,
        "failover",
        tmp,
        "--consul-url",
        consul,
        "--advertise-host",
        z.ns_ip,
        "--zones",
        ",".join(zones),
        "--health-interval-s",
        "0.2",
        "--watch-wait-s",
        "5",
        "--registry-timeout-s",
        "1",
        "--up-observations",
        "2",
        "--up-hold-s",
        "1",
        "--min-dwell-s",
        "3",
        "--ramp-s",
        "3",
        "--lkg-file",
        str(tmp / f"lkg-{z.name}.json"),
    )


def start_zone(
    z: netns.Zone, tmp: Path, consul: str, zones: list[str], workers: int, links: InterZoneLinks, replication: float
) -> ZoneProcs:
    """A zone's processes: the failover service beside the cache-manager, then the workers together, then the
    router (it names the workers' addresses). A start that fails stops what this call started."""
    zp = ZoneProcs(z)

    def worker(i: int, cm: ServiceProcess) -> ServiceProcess:
        flags = ["--engine", "sim", "--block-size", BS, "--kv-blocks", "4096", "--cache-manager", cm.address]
        return netns.start_in_zone(z, "worker", tmp, *flags, *links.worker_flags(i))

    started: list[ServiceProcess] = []
    with ThreadPoolExecutor(max_workers=max(2, workers)) as pool:
        failover = pool.submit(start_failover, z, tmp, consul, zones)
        try:
            cm = netns.start_in_zone(
                z, "cache-manager", tmp, "--block-size", BS, *links.cache_manager_flags(z, replication)
            )
            started.append(cm)
            futures = [pool.submit(worker, i, cm) for i in range(workers)]
            ws, errors = [], []
            for f in futures:  # every start waited for, so that each one that did start is stopped on an error
                try:
                    ws.append(f.result())
                except Exception as e:
                    errors.append(e)
            started += ws
            if errors:
                raise errors[0]
            router_flags = ["--workers", ",".join(w.address for w in ws), "--cache-manager", cm.address]
            started.append(netns.start_in_zone(z, "router", tmp, *router_flags, "--block-size", BS))
            zp.failover = failover.result()
        except BaseException:
            with contextlib.suppress(Exception):
                started.append(failover.result())
            for sp in started:
                sp.kill()
            raise
    zp.procs = started
    return zp


async def register(failover: ServiceProcess, procs: list[ServiceProcess], attempts: int = 60) -> None:
    """Register (router, workers, cache-manager) through a failover service; retried while Consul is down."""
    async with grpc.aio.insecure_channel(failover.address) as ch:
        stub = failover_pb2_grpc.FailoverServiceStub(ch)
        for sp in procs:
            ep = common_pb2.Endpoint(
                id=sp.info["id"], role=ROLES[sp.name], address=sp.address, zone=sp.info["zone"], version="v1"
            )
            for k in range(attempts):
                try:
                    await stub.Register(failover_pb2.RegisterRequest(endpoint=ep, check_interval_s=0.5), timeout=3)
                    break
                except grpc.aio.AioRpcError:
                    if k == attempts - 1:
                        raise
                    await asyncio.sleep(0.5)


async def deregister(failover: ServiceProcess, ids: list[str]) -> None:
    async with grpc.aio.insecure_channel(failover.address) as ch:
        stub = failover_pb2_grpc.FailoverServiceStub(ch)
        for iid in ids:
            await stub.Deregister(failover_pb2.DeregisterRequest(id=iid), timeout=3)


def kill(procs: list[ServiceProcess]) -> None:
    for sp in procs:
        sp.kill()


def session_prompt(idx: int, turn: int, context_tokens: int) -> list[int]:
    """Turn `turn` of session `idx`: a system prompt every session shares (`SYSTEM_TOKENS`), the session's own
    long context (up to `context_tokens` in all) and a short new question (16-47 tokens)."""
    system = [k % 30000 + 5 for k in range(SYSTEM_TOKENS)]
    own = [(idx * 7919 + k * 13) % 30000 + 5 for k in range(max(0, context_tokens - SYSTEM_TOKENS))]
    question = [(idx * 104729 + turn * 31 + k) % 30000 + 5 for k in range(16 + turn % 32)]
    return system + own + question


async def client_loop(idx: int, client: AsyncClient, stats: Stats, end: float, a: argparse.Namespace) -> None:
    """Session `idx`: turns one after another, `a.think_s` apart, until `end`."""
    n = 0
    while time.monotonic() < end:
        n += 1
        req = router_pb2.RouterServiceGenerateRequest(
            request_id=f"c{idx}-{n}",
            token_ids=common_pb2.TokenIds(ids=session_prompt(idx, n, a.context_tokens)),
            sampling=common_pb2.SamplingParams(max_tokens=a.max_tokens, ignore_eos=True),
            session_id=f"s{idx}",
        )
        stats.total += 1
        started = time.monotonic()
        got, usage = 0, common_pb2.Usage()
        try:
            async for m in client.generate(req):
                got += len(m.token_ids)
                if m.HasField("usage"):
                    usage = m.usage
        except Exception as e:
            stats.lost += 1
            stats.errors.append(f"{type(e).__name__}: {e}"[:300])
            continue
        if got > a.max_tokens:
            stats.duplicated += 1
        elif got < a.max_tokens:
            stats.lost += 1
            stats.errors.append(f"short stream: {got}/{a.max_tokens}")
        else:
            zone = next(z for c, _t, z in reversed(stats.attempts) if c == idx)  # the attempt that served it
            done = time.monotonic()
            served = Served(idx, n, done, zone, usage.prompt_tokens, usage.cached_tokens, done - started)
            stats.served.append(served)
        if a.think_s > 0:
            await asyncio.sleep(min(a.think_s, max(0.0, end - time.monotonic())))  # pacing, bounded by the run


async def watchers_moved(clients: list[AsyncClient], dead: str, t_kill: float, timeout_s: float) -> list[float]:
    """Seconds after `t_kill` until each client that followed `dead` receives endpoints from another
    failover service (polled every 20 ms, at most `timeout_s`)."""
    pending = {i for i, c in enumerate(clients) if c.watcher.connected_to == dead}
    out: list[float] = []
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for i in list(pending):
            now_at = clients[i].watcher.connected_to
            if now_at is not None and now_at != dead:
                out.append(time.monotonic() - t_kill)
                pending.discard(i)
        await asyncio.sleep(0.02)
    out += [timeout_s] * len(pending)
    return out


def read_port(proc: subprocess.Popen[str], timeout_s: float = 20.0) -> int:
    """The stand-in's ``{"port": N}`` line, waited for at most `timeout_s`."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        proc.kill()
        raise RuntimeError(f"consul stand-in did not start within {timeout_s}s")
    return int(json.loads(proc.stdout.readline())["port"])


async def sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.monotonic()))


async def run(a: argparse.Namespace) -> dict[str, Any]:
    reason = netns.available()
    if reason:
        raise SystemExit(f"failover bench: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-bench-failover-"))
    zones = [netns.create_zone(chr(ord("a") + k), k) for k in range(a.zones)]
    names = [z.name for z in zones]
    replication = a.replication_bytes_per_s if a.replication == "on" else 0.0
    consul_proc: subprocess.Popen[str] | None = None
    links: InterZoneLinks | None = None
    zps: list[ZoneProcs] = []
    clients: list[AsyncClient] = []
    keep_logs = True  # until the run has its result: a run that fails leaves its services' logs behind
    try:
        links = InterZoneLinks(zones, a.workers_per_zone, a.link_delay_ms, a.link_rate)
        sync, sync_unleased = await figures.sync_probe(
            zones[0], a.link_delay_ms, a.link_rate, transport=a.sync_transport
        )
        if a.consul_url:
            consul_urls = {z.name: a.consul_url for z in zones}
        else:
            hosts = ["--host", "127.0.0.1"] + [x for z in zones for x in ("--host", z.host_ip)]
            consul_proc = subprocess.Popen(
                [sys.executable, "-m", "tests.consul_standin", "--port", "0", *hosts],
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            port = read_port(consul_proc)
            consul_urls = {z.name: f"http://{z.host_ip}:{port}" for z in zones}

        def zone_up(z: netns.Zone, folder: Path) -> ZoneProcs:
            assert links is not None
            return start_zone(z, folder, consul_urls[z.name], names, a.workers_per_zone, links, replication)

        ups = await asyncio.gather(
            *(asyncio.to_thread(zone_up, z, tmp / z.name) for z in zones), return_exceptions=True
        )
        zps += [zp for zp in ups if isinstance(zp, ZoneProcs)]  # the teardown stops what did start
        for up in ups:
            if isinstance(up, BaseException):
                raise up
        for zp in zps:
            assert zp.failover is not None
            await register(zp.failover, zp.procs)
        stats = Stats()
        fo_addrs = [zp.failover.address for zp in zps if zp.failover]

        def recorder(ci: int) -> Any:
            def rec(inst: ServiceInstance) -> None:
                stats.attempts.append((ci, time.monotonic(), inst.zone))

            return rec

        for ci in range(a.clients):
            order = fo_addrs[ci % len(fo_addrs) :] + fo_addrs[: ci % len(fo_addrs)]
            home = names[ci % len(names)]  # a session stays in its own zone while that zone takes its full share
            c = AsyncClient(order, timeout_s=60, max_attempts=10, on_attempt=recorder(ci), prefer_zone=home)
            await c.start()
            clients.append(c)
        # wait until every client sees every zone's router (bounded)
        ready_by = time.monotonic() + 60
        while any(len(c.watcher.current.router_weights) < a.zones for c in clients):
            if time.monotonic() > ready_by:
                raise RuntimeError("clients did not see every zone's router within 60 s")
            await clients[0].watcher.wait_update(clients[0].watcher.updates, 0.5)

        t0 = time.monotonic()
        d = a.duration
        end = t0 + d
        loops = [asyncio.create_task(client_loop(ci, c, stats, end, a)) for ci, c in enumerate(clients)]
        victim = zps[0]
        t_kill = t0 + 0.25 * d
        t_restore_start = t0 + 0.5 * d
        t_restored = None
        holds_before = {o: (0.0, 0.0) for o in figures.REWARM_OUTCOMES}
        watch_moved: list[float] = []
        before_kill: dict[str, Any] = {}
        partition: dict[str, Any] = {}
        if a.scenario == "consul":
            assert consul_proc is not None, "--scenario consul needs the stand-in"
            await sleep_until(t0 + 0.15 * d)
            consul_proc.send_signal(signal.SIGSTOP)
            t_resume = time.monotonic() + a.consul_stop_s
            await sleep_until(t_kill)
            victim.zone.partition()
            kill([*victim.procs, *([victim.failover] if victim.failover else [])])
            await sleep_until(t_resume)
            consul_proc.send_signal(signal.SIGCONT)
            t_restore_start = max(t_restore_start, time.monotonic())
        elif a.scenario == "zone":
            await sleep_until(t_kill)
            before_kill = zone_figures(zps, t_kill - t0)
            victim.zone.partition()
            kill([*victim.procs, *([victim.failover] if victim.failover else [])])
            await sleep_until(t_restore_start)
        elif a.scenario == "failover":
            await sleep_until(t_kill)
            dead = victim.failover.address if victim.failover else ""
            kill([victim.failover] if victim.failover else [])
            watch_moved = await watchers_moved(clients, dead, t_kill, timeout_s=15.0)
            await sleep_until(t_restore_start)
        elif a.scenario == "partition":
            await sleep_until(t_kill)
            links.cut()
            t_heal = t_kill + a.partition_s
            await sleep_until(t_heal)
            links.heal()
            partition = {"partition_s": a.partition_s, "requests_moved": moved(stats, names, t_kill, t_heal)}
        else:
            raise SystemExit(f"unknown scenario {a.scenario!r}")

        # restore zone 0
        if a.scenario in ("zone", "consul"):
            survivor = zps[1]
            assert survivor.failover is not None
            holds_before = await asyncio.to_thread(figures.rewarm_holds, survivor.failover, survivor.zone.ns_ip)
            old_ids = [sp.info["id"] for sp in victim.procs]
            victim.zone.heal()
            new = await asyncio.to_thread(zone_up, victim.zone, tmp / f"{victim.zone.name}-2")
            assert new.failover is not None and zps[1].failover is not None
            await deregister(zps[1].failover, old_ids)
            await register(new.failover, new.procs)
            zps[0] = new
        elif a.scenario == "failover":
            zps[0].failover = await asyncio.to_thread(
                start_failover, victim.zone, tmp / "a-fo2", consul_urls[victim.zone.name], names
            )
        t_restored = time.monotonic()
        await asyncio.gather(*loops)
        if a.scenario == "partition":
            partition.update(await converged(zps))
        extra = {
            "sync": sync,
            "sync_unleased": sync_unleased,
            "before_kill": before_kill,
            "partition": partition,
            "watch_moved": watch_moved,
        }
        if a.scenario in ("zone", "consul"):  # the surviving zone's failover service saw the whole restore
            survivor = zps[1]
            assert survivor.failover is not None
            extra["rewarm"] = await asyncio.to_thread(
                figures.rewarm_hold, survivor.failover, survivor.zone.ns_ip, holds_before
            )
        line = result_line(a, stats, clients, names, (t_kill, t_restore_start, t_restored), extra)
        keep_logs = False
        return line
    finally:
        for c in clients:
            await c.close()
        for zp in zps:
            kill([*zp.procs, *([zp.failover] if zp.failover else [])])
        if links is not None:
            links.close()
        if consul_proc is not None and consul_proc.poll() is None:
            consul_proc.send_signal(signal.SIGCONT)
            consul_proc.kill()
            consul_proc.wait(5)
        for z in zones:
            z.destroy()
        if keep_logs:
            print(f"failover bench: the services' logs are in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def moved(stats: Stats, names: list[str], start: float, stop: float) -> int:
    """Requests a client sent to a zone other than its own between `start` and `stop`."""
    return sum(1 for c, t, z in stats.attempts if start <= t < stop and z != names[c % len(names)])


def zone_figures(zps: list[ZoneProcs], elapsed_s: float) -> dict[str, Any]:
    """Just before zone A is killed: B's lag following A, A's replication bytes per second so far."""
    a, b = zps[0], zps[1]
    return {
        "index_lag_ms": figures.nan_to_none(figures.lag_ms(b.procs[0], b.zone.ns_ip, a.zone.name)),
        "replication_bytes_per_s": round(figures.replication_bytes(a.procs[0], a.zone.ns_ip) / elapsed_s, 1),
    }


async def converged(zps: list[ZoneProcs], timeout_s: float = 30.0) -> dict[str, Any]:
    """The follow and replication counters once every follower is connected again (bounded)."""
    cms = [(zp.procs[0], zp.zone.ns_ip) for zp in zps]
    deadline = time.monotonic() + timeout_s
    out = await figures.convergence(cms)
    while not out["followed_connected"] and time.monotonic() < deadline:
        await asyncio.sleep(0.2)  # the poll's interval: the followers' reconnect back-off is at most 2 s
        out = await figures.convergence(cms)
    return out


def request_seconds(served: list[Served]) -> dict[str, float] | None:
    """p50 and max of the served requests' durations (a request stuck on a dead zone shows in the max)."""
    s = sorted(r.seconds for r in served)
    return {"p50": round(s[len(s) // 2], 3), "max": round(s[-1], 3)} if s else None


def result_line(
    a: argparse.Namespace,
    stats: Stats,
    clients: list[AsyncClient],
    names: list[str],
    times: tuple[float, float, float],
    extra: dict[str, Any],
) -> dict[str, Any]:
    t_kill, t_restore_start, t_restored = times
    zone0 = names[0]
    killed = a.scenario in ("zone", "consul")
    switch = []
    for ci in range(a.clients):
        to0 = [t for (c, t, z) in stats.attempts if c == ci and z == zone0 and t_kill <= t < t_restore_start]
        switch.append(max(0.0, max(to0) - t_kill) if to0 else 0.0)
    back = [t for (_, t, z) in stats.attempts if z == zone0 and t >= t_restored]
    home = {ci: names[ci % len(names)] for ci in range(a.clients)}
    post_end = min(t_kill + POST_SWITCH_WINDOW_S, t_restore_start)
    watch_moved = extra["watch_moved"]
    result: dict[str, Any] = {
        "bench": "failover",
        "scenario": a.scenario,
        "replication": a.replication,
        "zones": a.zones,
        "workers_per_zone": a.workers_per_zone,
        "clients": a.clients,
        "duration_s": a.duration,
        "switchover_s": {"p50": round(statistics.median(switch), 3), "max": round(max(switch), 3)}
        if killed
        else {"p50": 0.0, "max": 0.0},
        "outage_s": round(t_restore_start - t_kill, 3) if a.scenario != "partition" else 0.0,
        "requests_total": stats.total,
        "requests_lost": stats.lost,
        "requests_duplicated": stats.duplicated,
        "failback_s": round(min(back) - t_restored, 3) if back and a.scenario != "partition" else None,
        "request_s": request_seconds(stats.served),
        "attempts": len(stats.attempts),
        "resumes": sum(c.resumes_total for c in clients),
        "consul": a.consul_url or "stand-in",
        "link": {"delay_ms_each_way": a.link_delay_ms, "rate_bytes_per_s": a.link_rate},
        "cross_zone_sync_ms": extra["sync"],
        "cross_zone_sync_unleased_ms": extra["sync_unleased"],
        "cross_zone_sync_transport": a.sync_transport,
        "errors": stats.errors[:5],
    }
    if killed:
        result.update(figures.hit_figures(stats.served, home, zone0, t_kill, post_end, t_restored))
    if "rewarm" in extra:
        result["failback_rewarm_hold_s"] = extra["rewarm"]
    result.update(extra["before_kill"])
    if a.scenario == "partition":
        result.update(extra["partition"])
    if a.scenario == "failover":
        result["watch_failover_s"] = {"max": round(max(watch_moved), 3)} if watch_moved else None
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvmesh.bench failover",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--zones", type=int, default=2)
    p.add_argument("--workers-per-zone", type=int, default=2)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=12, help="sessions; session i belongs to zone i mod zones")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--scenario", choices=("zone", "failover", "consul", "partition"), default="zone")
    p.add_argument("--replication", choices=("on", "off"), default="on", help="hot-prefix replication between zones")
    p.add_argument("--replication-bytes-per-s", type=float, default=50e6, help="each zone's replication budget")
    p.add_argument("--link-delay-ms", type=float, default=0.5, help="inter-zone link: added each way")
    p.add_argument("--link-rate", type=float, default=1.25e9, help="inter-zone link: bytes/s per connection and way")
    p.add_argument(
        "--sync-transport",
        choices=("mooncake", "grpc"),
        default="mooncake",
        help="the cross-zone sync probe's kv-sync transport (a 32-block pull across the emulated link)",
    )
    p.add_argument("--partition-s", type=float, default=30.0, help="--scenario partition: how long the link is cut")
    p.add_argument("--context-tokens", type=int, default=1024, help="a session's prompt before its new question")
    p.add_argument("--think-s", type=float, default=1.0, help="pause between a session's turns")
    p.add_argument("--consul-stop-s", type=float, default=30.0)
    p.add_argument("--consul-url", default="", help="a real Consul agent instead of the stand-in")
    a = p.parse_args(argv)
    if a.zones < 2:
        p.error("--zones must be >= 2")
    print(json.dumps(asyncio.run(run(a))), flush=True)
    return 0
