"""``python -m kvmesh.bench failover --zones 2 --workers-per-zone 2 --duration 60 [--scenario zone]``.

Each zone runs in its own network namespace (`kvmesh.bench.netns`): cache-manager, simulated workers,
router and failover service, all real processes; Consul is the test STAND-IN (``python -m
tests.consul_standin``) in the root namespace, or a real agent with ``--consul-url``. `--clients`
independent `kvmesh.client.AsyncClient`s (each following the failover services, its own zone's
first) send requests in a loop for the whole run. Scenarios (times as fractions of --duration):

* ``zone``: at 25 % zone 0 dies (SIGKILL of all its processes, failover service included, and its
  link cut); at 50 % the link is healed and its processes restarted and registered.
* ``failover``: at 25 % only zone 0's failover service is SIGKILLed; restarted at 50 %.
* ``consul``: Consul is stopped (SIGSTOP) from 15 % for ``--consul-stop-s`` seconds; zone 0 dies at
  25 % while Consul is stopped (endpoint sets are last-known-good); restored after Consul is back.

Prints one JSON line. ``switchover_s``: per client, ``max(0, last send to zone 0 in [kill,
restore) - kill)`` (the time until that client sends only to other zones), p50 and max over
clients; ``outage_s``: from the kill to the start of the restore; ``requests_lost``: requests that
failed or ended short; ``requests_duplicated``: requests that delivered more tokens than asked;
``failback_s``: from zone 0 restored (serving and registered) to the first request a client sends to it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc.aio

import kvmesh
from kvmesh.bench import netns
from kvmesh.client import AsyncClient
from kvmesh.discovery.model import ServiceInstance
from kvmesh.launcher import ServiceProcess
from kvmesh.v1 import common_pb2, failover_pb2, failover_pb2_grpc, router_pb2

REPO = Path(kvmesh.__file__).resolve().parents[2]
BS = "32"
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


def start_zone(z: netns.Zone, tmp: Path, consul: str, zones: list[str], workers: int) -> ZoneProcs:
    zp = ZoneProcs(z)
    cm = netns.start_in_zone(z, "cache-manager", tmp, "--block-size", BS)
    zp.procs.append(cm)
    ws = [
        netns.start_in_zone(
            z,
            "worker",
            tmp,
            "--engine",
            "sim",
            "--block-size",
            BS,
            "--kv-blocks",
            "4096",
            "--cache-manager",
            cm.address,
        )
        for _ in range(workers)
    ]
    zp.procs += ws
    zp.procs.append(
        netns.start_in_zone(
            z,
            "router",
            tmp,
            "--workers",
            ",".join(w.address for w in ws),
            "--cache-manager",
            cm.address,
            "--block-size",
            BS,
        )
    )
    zp.failover = start_failover(z, tmp, consul, zones)
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


async def client_loop(idx: int, client: AsyncClient, stats: Stats, end: float, max_tokens: int) -> None:
    prompt = [(idx * 7919 + k) % 30000 + 5 for k in range(96)]
    n = 0
    while time.monotonic() < end:
        n += 1
        req = router_pb2.RouterServiceGenerateRequest(
            request_id=f"c{idx}-{n}",
            token_ids=common_pb2.TokenIds(ids=prompt[: 64 + n % 32]),
            sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            session_id=f"s{idx}",
        )
        stats.total += 1
        got = 0
        try:
            async for m in client.generate(req):
                got += len(m.token_ids)
        except Exception as e:
            stats.lost += 1
            stats.errors.append(f"{type(e).__name__}: {e}"[:300])
            continue
        if got > max_tokens:
            stats.duplicated += 1
        elif got < max_tokens:
            stats.lost += 1
            stats.errors.append(f"short stream: {got}/{max_tokens}")


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
    consul_proc: subprocess.Popen[str] | None = None
    zps: list[ZoneProcs] = []
    clients: list[AsyncClient] = []
    try:
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
        for z in zones:
            zps.append(
                await asyncio.to_thread(start_zone, z, tmp / z.name, consul_urls[z.name], names, a.workers_per_zone)
            )
        for zp in zps:
            assert zp.failover is not None
            await register(zp.failover, zp.procs)
        zone_of = {sp.info["id"]: sp.info["zone"] for zp in zps for sp in zp.procs}
        stats = Stats()
        fo_addrs = [zp.failover.address for zp in zps if zp.failover]

        def recorder(ci: int) -> Any:
            def rec(inst: ServiceInstance) -> None:
                stats.attempts.append((ci, time.monotonic(), inst.zone))

            return rec

        for ci in range(a.clients):
            order = fo_addrs[ci % len(fo_addrs) :] + fo_addrs[: ci % len(fo_addrs)]
            c = AsyncClient(order, timeout_s=60, max_attempts=10, on_attempt=recorder(ci))
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
        loops = [asyncio.create_task(client_loop(ci, c, stats, end, a.max_tokens)) for ci, c in enumerate(clients)]
        victim = zps[0]
        t_kill = t0 + 0.25 * d
        t_restore_start = t0 + 0.5 * d
        t_restored = None
        watch_moved: list[float] = []
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
            victim.zone.partition()
            kill([*victim.procs, *([victim.failover] if victim.failover else [])])
            await sleep_until(t_restore_start)
        elif a.scenario == "failover":
            await sleep_until(t_kill)
            dead = victim.failover.address if victim.failover else ""
            kill([victim.failover] if victim.failover else [])
            watch_moved = await watchers_moved(clients, dead, t_kill, timeout_s=15.0)
            await sleep_until(t_restore_start)
        else:
            raise SystemExit(f"unknown scenario {a.scenario!r}")

        # restore zone 0
        old_ids = [sp.info["id"] for sp in victim.procs]
        if a.scenario in ("zone", "consul"):
            victim.zone.heal()
            new = await asyncio.to_thread(
                start_zone,
                victim.zone,
                tmp / f"{victim.zone.name}-2",
                consul_urls[victim.zone.name],
                names,
                a.workers_per_zone,
            )
            assert new.failover is not None and zps[1].failover is not None
            await deregister(zps[1].failover, old_ids)
            await register(new.failover, new.procs)
            zone_of.update({sp.info["id"]: sp.info["zone"] for sp in new.procs})
            zps[0] = new
        else:
            zps[0].failover = await asyncio.to_thread(
                start_failover, victim.zone, tmp / "a-fo2", consul_urls[victim.zone.name], names
            )
        t_restored = time.monotonic()
        await asyncio.gather(*loops)

        zone0 = names[0]
        switch = []
        for ci in range(a.clients):
            to0 = [t for (c, t, z) in stats.attempts if c == ci and z == zone0 and t_kill <= t < t_restore_start]
            switch.append(max(0.0, max(to0) - t_kill) if to0 else 0.0)
        back = [t for (_, t, z) in stats.attempts if z == zone0 and t >= t_restored]
        result = {
            "bench": "failover",
            "scenario": a.scenario,
            "zones": a.zones,
            "workers_per_zone": a.workers_per_zone,
            "clients": a.clients,
            "duration_s": d,
            "switchover_s": {"p50": round(statistics.median(switch), 3), "max": round(max(switch), 3)}
            if a.scenario != "failover"
            else {"p50": 0.0, "max": 0.0},
            "outage_s": round(t_restore_start - t_kill, 3),
            "requests_total": stats.total,
            "requests_lost": stats.lost,
            "requests_duplicated": stats.duplicated,
            "failback_s": round(min(back) - t_restored, 3) if back else None,
            "attempts": len(stats.attempts),
            "resumes": sum(c.resumes_total for c in clients),
            "consul": a.consul_url or "stand-in",
            "errors": stats.errors[:5],
            **(
                {"watch_failover_s": {"max": round(max(watch_moved), 3)} if watch_moved else None}
                if a.scenario == "failover"
                else {}
            ),
        }
        return result
    finally:
        for c in clients:
            await c.close()
        for zp in zps:
            kill([*zp.procs, *([zp.failover] if zp.failover else [])])
        if consul_proc is not None and consul_proc.poll() is None:
            consul_proc.send_signal(signal.SIGCONT)
            consul_proc.kill()
            consul_proc.wait(5)
        for z in zones:
            z.destroy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvmesh.bench failover",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--zones", type=int, default=2)
    p.add_argument("--workers-per-zone", type=int, default=2)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--scenario", choices=("zone", "failover", "consul"), default="zone")
    p.add_argument("--consul-stop-s", type=float, default=30.0)
    p.add_argument("--consul-url", default="", help="a real Consul agent instead of the stand-in")
    a = p.parse_args(argv)
    if a.zones < 2:
        p.error("--zones must be >= 2")
    print(json.dumps(asyncio.run(run(a))), flush=True)
    return 0
