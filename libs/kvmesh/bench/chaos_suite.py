"""The chaos campaign's suite: two zones of real processes (`kvmesh.bench.netns` namespaces, the emulated
inter-zone link of `kvmesh.bench.zone_link`, the Consul STAND-IN in the root namespace), each process on a
fixed address inside its zone so that a killed or stopped one comes back where its peers, its registration
and the clients look for it.

Per zone: a cache-manager (following the other zone over the link and replicating hot prefixes into its workers'
CPU tiers, as `kvmesh.bench.failover.start_zone` sets it up), `workers_per_zone` simulated workers (real-time
simulated compute, `--sim-speed`, and a small KV pool that long sessions can fill), a router and a failover
service and a planner (dry-run: it reads its zone's load through the router and logs what it would do). With
`pd`, each zone's worker-0 is a prefill worker and the others decode workers: the routers hand long prompts' KV
over from one to the other (kv-sync), and the faults meet handoffs. The routers enforce the authorisation table
with bearer tokens provisioned here: the campaign's clients call as a client, the planner service as the
planner, the rogue planner as another planner.

The cache-managers checkpoint every `checkpoint_interval_s`: the first zone's into a redis-server of its own
(a process target like the services), the other zone's into files on a small tmpfs mounted for the run (so
that "the store is full" is a real ENOSPC).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc.aio

from kvmesh.bench import netns
from kvmesh.bench.failover import BS, REPO, read_port, register
from kvmesh.bench.zone_link import CM_PORT, InterZoneLinks
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.security.tokens import accepted_file, provision
from kvmesh.suite.launcher import ServiceProcess, vllm_core_env, wait_serving
from kvmesh.suite.local import redis_answers

WORKER_PORT = 47200  # worker i: gRPC WORKER_PORT + i, HTTP WORKER_PORT + 50 + i
ROUTER_PORT = 47300  # HTTP ROUTER_PORT + 1
FAILOVER_PORT = 47400
PLANNER_PORT = 47450
REDIS_PORT = 47500
VLLM_START_S = 300  # a vLLM engine's start on a busy 2-core host (model load, its CPU KV cache, warm-up)
# a vLLM worker's environment: a small CPU KV cache (GiB), no model hub
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TORCHDYNAMO_DISABLE": "1",
}
CLIENT = Identity(CallerRole.CLIENT, "chaos-client")
PLANNER = Identity(CallerRole.PLANNER, "chaos-rogue-planner")
PLANNER_SERVICE = Identity(CallerRole.PLANNER, "chaos-planner")


@dataclass
class SuiteConfig:
    workers_per_zone: int = 2
    sim_speed: float = 1.0
    kv_blocks: int = 1024  # 32-token blocks: a handful of 4k-token sessions fill it
    max_model_len: int = 4096
    link_delay_ms: float = 0.5
    link_rate: float = 1.25e9
    replication_bytes_per_s: float = 50e6
    checkpoint_interval_s: float = 2.0
    checkpoint_tmpfs_mb: int = 16
    pd: bool = False  # worker-0 of each zone a prefill worker, the others decode workers (handoffs over kv-sync)
    model: str = ""  # a model folder: every worker a real vLLM engine serving it (and the routers its tokenizer)


@dataclass
class Suite:
    """Started by `start_suite`; `procs` maps a target (``a/router``, ``b/worker-1``...) to its process."""

    tmp: Path
    config: SuiteConfig
    zones: list[netns.Zone] = field(default_factory=list)
    links: InterZoneLinks | None = None
    consul: subprocess.Popen[str] | None = None
    consul_port: int = 0
    procs: dict[str, ServiceProcess] = field(default_factory=dict)
    args: dict[str, tuple[netns.Zone, str, list[str]]] = field(default_factory=dict)
    envs: dict[str, dict[str, str]] = field(default_factory=dict)  # target -> its extra environment (vLLM's)
    pids: set[int] = field(default_factory=set)  # every process the suite ever started (shm ownership)
    tokens: dict[str, str] = field(default_factory=dict)  # identity id -> its bearer token
    token_files: dict[str, Path] = field(default_factory=dict)  # identity id -> its token file
    checkpoint_dirs: dict[str, Path] = field(default_factory=dict)  # zone -> its tmpfs (file checkpoints)

    def redis_zone(self) -> str:
        """The zone whose cache-manager checkpoints into Redis (the first; the others into files)."""
        return self.zones[0].name

    def redis_url(self) -> str:
        return f"redis://{self.zones[0].ns_ip}:{REDIS_PORT}/0"

    def zone(self, name: str) -> netns.Zone:
        return next(z for z in self.zones if z.name == name)

    def address(self, target: str) -> str:
        return self.procs[target].address

    def router_http(self, zone: str) -> str:
        return f"http://{self.zone(zone).ns_ip}:{ROUTER_PORT + 1}"

    def failover_addresses(self) -> list[str]:
        return [f"{z.ns_ip}:{FAILOVER_PORT}" for z in self.zones]

    def workers(self, zone: str) -> list[str]:
        return [t for t in self.procs if t.startswith(f"{zone}/worker-")]

    def start(self, target: str, extra: Sequence[str] = ()) -> ServiceProcess:
        """(Re)starts `target` on its fixed address (`extra` flags after its own) and waits until it serves."""
        zone, name, args = self.args[target]
        if name == "redis-server":
            sp = start_redis(zone, self.tmp / zone.name)
        else:
            env = self.envs.get(target)
            timeout = VLLM_START_S if env else 90
            sp = netns.start_in_zone(zone, name, self.tmp / zone.name, *args, *extra, timeout=timeout, env=env)
        self.procs[target] = sp
        self.pids.add(sp.proc.pid)
        return sp


def start_redis(zone: netns.Zone, tmp: Path, timeout_s: float = 15.0) -> ServiceProcess:
    """redis-server inside the zone's namespace on its fixed address, no persistence (a restart forgets the
    checkpoint: the cache-manager's next one writes it again); waits until it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("chaos bench: redis-server is not installed (run scripts/bootstrap.sh)")
    tmp.mkdir(parents=True, exist_ok=True)
    log_path = tmp / f"redis-{zone.name}-{time.monotonic_ns()}.log"
    cmd = ["ip", "netns", "exec", zone.ns, binary, "--port", str(REDIS_PORT), "--bind", zone.ns_ip]
    # reached from the other namespaces' addresses: Redis's protected mode would refuse every non-loopback
    # client of a server without a password (this one lives only in the run's private namespace)
    cmd += ["--save", "", "--appendonly", "no", "--dir", str(tmp), "--protected-mode", "no"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"{zone.ns_ip}:{REDIS_PORT}"
    sp = ServiceProcess("redis-server", proc, log_path, log_path, {"grpc": address})
    if not redis_answers(zone.ns_ip, REDIS_PORT, timeout_s, proc):
        proc.kill()
        raise RuntimeError(f"redis-server did not answer on {address}: {sp.log()[-500:]}")
    return sp


def redis_ping(address: str, timeout_s: float) -> None:
    """Raises RuntimeError unless the Redis at `address` answers PING within `timeout_s`."""
    host, port = address.rsplit(":", 1)
    if not redis_answers(host, int(port), timeout_s):
        raise RuntimeError(f"redis {address}: no answer to PING within {timeout_s}s")


def _plan(suite: Suite, z: netns.Zone) -> None:
    """Every process of zone `z`: its service and its flags (fixed ports: the later ``--port`` wins)."""
    c, links = suite.config, suite.links
    assert links is not None
    cm_addr = f"{z.ns_ip}:{CM_PORT}"
    names = [x.name for x in suite.zones]
    cm_flags = links.cache_manager_flags(z, c.replication_bytes_per_s)
    if z.name == suite.redis_zone():
        store = ["--redis-url", suite.redis_url()]
        suite.args[f"{z.name}/redis"] = (z, "redis-server", [])
    else:
        store = ["--checkpoint-dir", str(suite.checkpoint_dirs[z.name])]
    store += ["--checkpoint-interval-s", str(c.checkpoint_interval_s)]
    suite.args[f"{z.name}/cache-manager"] = (
        z,
        "cache-manager",
        ["--block-size", BS, "--http-port", "47101", *cm_flags, *store],
    )
    workers = []
    # the vLLM engines share the host's cores unpinned, an equal share each as their thread count (pinned, a
    # restarted engine and the one beside it would spin on the same cores)
    engine_envs = vllm_core_env(c.workers_per_zone * len(names), pinned=False)
    for i in range(c.workers_per_zone):
        port = WORKER_PORT + i
        workers.append(f"{z.ns_ip}:{port}")
        flags = ["--port", str(port), "--http-port", str(port + 50), "--block-size", BS]
        flags += ["--max-model-len", str(c.max_model_len), "--cache-manager", cm_addr, *links.worker_flags(i)]
        if c.model:  # the same small KV pool as the simulated workers', so that long sessions can fill it
            flags += ["--engine", "vllm", "--model", c.model]
            # eager: no graph compilation at start, so that a killed engine is back in seconds, not a minute
            flags += ["--vllm-args", f"--num-gpu-blocks-override {c.kv_blocks} --enforce-eager"]
            suite.envs[f"{z.name}/worker-{i}"] = {**VLLM_ENV, **engine_envs[i]}
        else:
            flags += ["--engine", "sim", "--sim-speed", str(c.sim_speed), "--kv-blocks", str(c.kv_blocks)]
        if c.pd:
            flags += ["--role", "prefill" if i == 0 else "decode"]
        suite.args[f"{z.name}/worker-{i}"] = (z, "worker", flags)
    auth = ["--auth-mode", "enforce", "--auth-tokens-file", str(accepted_file(suite.tmp / "auth"))]
    suite.args[f"{z.name}/router"] = (
        z,
        "router",
        [
            *("--port", str(ROUTER_PORT), "--http-port", str(ROUTER_PORT + 1)),
            *("--workers", ",".join(workers), "--cache-manager", cm_addr, "--block-size", BS, *auth),
            *(("--model", c.model) if c.model else ()),
        ],
    )
    consul = f"http://{z.host_ip}:{suite.consul_port}"
    suite.args[f"{z.name}/failover"] = (
        z,
        "failover",
        [
            *("--port", str(FAILOVER_PORT), "--http-port", str(FAILOVER_PORT + 1)),
            *("--consul-url", consul, "--advertise-host", z.ns_ip, "--zones", ",".join(names)),
            *("--health-interval-s", "0.2", "--watch-wait-s", "5", "--registry-timeout-s", "1"),
            *("--up-observations", "2", "--up-hold-s", "1", "--min-dwell-s", "3", "--ramp-s", "3"),
            *("--lkg-file", str(suite.tmp / f"lkg-{z.name}.json")),
        ],
    )
    suite.args[f"{z.name}/planner"] = (
        z,
        "planner",
        [
            *("--port", str(PLANNER_PORT), "--http-port", str(PLANNER_PORT + 1)),
            *("--routers", f"{z.name}={z.ns_ip}:{ROUTER_PORT}", "--actuator", "dry-run", "--interval-s", "2"),
            *("--auth-token-file", str(suite.token_files[PLANNER_SERVICE.id])),
            *("--history-file", str(suite.tmp / f"planner-history-{z.name}.json")),
        ],
    )


async def start_suite(tmp: Path, config: SuiteConfig) -> Suite:
    """Namespaces, link, Consul stand-in and every process of both zones, registered through their zone's
    failover service. A start that fails tears down what it had started before raising."""
    reason = netns.available()
    if reason:
        raise SystemExit(f"chaos bench: {reason}")
    suite = Suite(tmp, config)
    try:
        await _start(suite)
    except BaseException:
        await asyncio.to_thread(stop_suite, suite)
        raise
    return suite


async def _start(suite: Suite) -> None:
    config = suite.config
    own = provision(suite.tmp / "auth", [CLIENT, PLANNER, PLANNER_SERVICE])
    suite.tokens = {ident.id: path.read_text().strip() for ident, path in own.items()}
    suite.token_files = {ident.id: path for ident, path in own.items()}
    for k, name in enumerate(("a", "b")):
        suite.zones.append(netns.create_zone(name, k))  # one at a time: a failed second leaves the first to stop
    for z in suite.zones[1:]:
        suite.checkpoint_dirs[z.name] = mount_tmpfs(suite.tmp / f"checkpoints-{z.name}", config.checkpoint_tmpfs_mb)
    suite.links = InterZoneLinks(suite.zones, config.workers_per_zone, config.link_delay_ms, config.link_rate)
    hosts = ["--host", "127.0.0.1"] + [x for z in suite.zones for x in ("--host", z.host_ip)]
    suite.consul = subprocess.Popen(
        [sys.executable, "-m", "tests.consul_standin", "--port", "0", *hosts],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    suite.consul_port = read_port(suite.consul)
    for z in suite.zones:
        _plan(suite, z)
    stores = [t for t in suite.args if t.endswith("/redis")]
    await asyncio.gather(*(asyncio.to_thread(suite.start, t) for t in stores))
    first = [t for t in suite.args if t.endswith(("/cache-manager", "/failover"))]
    await asyncio.gather(*(asyncio.to_thread(suite.start, t) for t in first))
    rest = [t for t in suite.args if t not in first and t not in stores and not t.endswith("/planner")]
    await asyncio.gather(*(asyncio.to_thread(suite.start, t) for t in rest))
    planners = [t for t in suite.args if t.endswith("/planner")]  # after the routers they read
    await asyncio.gather(*(asyncio.to_thread(suite.start, t) for t in planners))
    for z in suite.zones:
        members = [
            sp
            for t, sp in suite.procs.items()
            if t.startswith(f"{z.name}/") and not t.endswith(("/failover", "/redis", "/planner"))
        ]
        await register(suite.procs[f"{z.name}/failover"], members)


def mount_tmpfs(path: Path, size_mb: int) -> Path:
    """A tmpfs of `size_mb` MiB at `path` (a store that can really fill up); unmounted by `stop_suite`."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0700", "tmpfs", str(path)], check=True)
    return path


def signal_process(suite: Suite, target: str, sig: signal.Signals) -> None:
    """`sig` to the target's process alone (not through `ServiceProcess.kill`, which also removes the shared
    memory a killed process leaves: finding that left behind is the campaign's job)."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(suite.procs[target].proc.pid, sig)


def wait_exit(suite: Suite, target: str, timeout_s: float) -> int | None:
    """The target's exit code once it has exited (None if still running after `timeout_s`)."""
    try:
        return suite.procs[target].proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None


async def all_serving(suite: Suite, timeout_s: float) -> dict[str, str]:
    """Health of every process (grpc.health.v1), each waited for at most `timeout_s`: target -> "" when
    SERVING, else what went wrong."""

    async def one(target: str) -> tuple[str, str]:
        check = redis_ping if target.endswith("/redis") else wait_serving
        try:
            await asyncio.to_thread(check, suite.address(target), timeout_s)
            return target, ""
        except (grpc.RpcError, RuntimeError) as e:
            return target, str(e)[:200]

    return dict(await asyncio.gather(*(one(t) for t in suite.procs)))


def stop_suite(suite: Suite, timeout_s: float = 20.0) -> None:
    """SIGTERM (SIGCONT first: a stopped one cannot exit) every process, SIGKILL the late ones, then the
    link, the stand-in and the namespaces."""
    for sp in suite.procs.values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(sp.proc.pid, signal.SIGCONT)
            os.kill(sp.proc.pid, signal.SIGTERM)
    for sp in suite.procs.values():
        try:
            sp.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(sp.proc.pid, signal.SIGKILL)
            sp.proc.wait(timeout=10)
    if suite.links is not None:
        suite.links.close()
    if suite.consul is not None and suite.consul.poll() is None:
        suite.consul.kill()
        suite.consul.wait(5)
    for path in suite.checkpoint_dirs.values():
        subprocess.run(["umount", "-l", str(path)], check=False)
    for z in suite.zones:
        z.destroy()
