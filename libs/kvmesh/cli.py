"""`kvmesh`: the umbrella command.

    kvmesh up [--workers N] [--engine sim|vllm] [--redis] [--tls] [--detach]   start the whole suite locally
    kvmesh status                                                      health of every service of the suite
    kvmesh demo [--prompt TEXT]                                        one real request through the router
    kvmesh down                                                        stop a detached suite
    kvmesh certs DIR [--zone Z] [--workers N]                          a development CA and certificates
    kvmesh bench <index|worker|router|fleet|failover> ...              benchmarks (python -m kvmesh.bench)

`up` starts each service as its own process with embedded defaults: a static registry file instead of Consul
(the failover service probes its instances' gRPC health: a killed service leaves the endpoint sets in seconds),
file checkpoints instead of Redis (unless --redis), simulated workers unless --engine vllm (real vLLM on the
CPU with the tiny local model). State lives in `$KVMESH_HOME/run` (default `./var/run`).

`up` is least-privilege by default: it provisions an identity per service (a random bearer token in
`run/auth/`, mode 0600, readable by this user only) and starts every service with the authorisation table
enforced, so an anonymous caller reaches only the router's client API, the endpoint watch and health.
`run/auth/admin-operator.token` is the operator's admin token. `--tls` also makes a development CA
(`run/pki/`, as `kvmesh certs` does) and runs every connection over mTLS, identities from the certificates.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh import admin_cli
from kvmesh.discovery.model import CatalogSnapshot, Role, ServiceInstance
from kvmesh.discovery.static import write_catalog
from kvmesh.launcher import ServiceProcess, start_service, vllm_core_env
from kvmesh.security.certs import DevPki, make_dev_pki
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.security.tokens import accepted_file, provision


def kvmesh_home() -> Path:
    return Path(os.environ.get("KVMESH_HOME", Path.cwd() / "var")).resolve()


def run_dir() -> Path:
    return kvmesh_home() / "run"


def _state_path() -> Path:
    return run_dir() / "suite.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_redis(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server is not installed: run scripts/bootstrap.sh (or drop --redis)")
    port = _free_port()
    directory.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(directory),
            "--save",
            "",
            "--appendonly",
            "no",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    deadline = time.monotonic() + 15
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("redis-server did not start") from None
            time.sleep(0.05)
    return proc, f"redis://127.0.0.1:{port}/0"


def _write_registry(path: Path, procs: list[ServiceProcess]) -> None:
    """The suite's static registry (the failover service's `--registry-file`), in the registry's own format."""
    instances = []
    for p in procs:
        host, _, port = p.address.rpartition(":")
        zone = str(p.info.get("zone", "local"))
        meta = {"http": f"127.0.0.1:{p.info['http_port']}"}
        instances.append(ServiceInstance(p.info["id"], Role(p.name), zone, "v1", host, int(port), meta=meta))
    write_catalog(path, CatalogSnapshot.of(instances))


def suite_identities(zone: str, workers: int) -> dict[str, Identity]:
    """The identities `kvmesh up` (and `kvmesh certs`) provisions, by name; a worker's is named by its service
    id and carries it as its id, the worker its KV events name."""
    R = CallerRole
    return {
        "cache-manager": Identity(R.CACHE_MANAGER, f"cache-manager-{zone}", zone),
        **{f"worker-{zone}-{i}": Identity(R.WORKER, f"worker-{zone}-{i}", zone) for i in range(workers)},
        "router": Identity(R.ROUTER, f"router-{zone}", zone),
        "failover": Identity(R.FAILOVER, f"failover-{zone}", zone),
        "admin": Identity(R.ADMIN, "operator", zone),
        "client": Identity(R.CLIENT, "demo", zone, tenants=("demo",)),
        "peer-zone": Identity(R.PEER_ZONE, f"peer-of-{zone}", zone),
    }


class SuiteAuth:
    """Per-service identities of one suite: tokens always, certificates with `--tls`; the flags each service
    is started with, and the state `status` / `demo` connect with."""

    def __init__(self, rd: Path, zone: str, workers: int, tls: bool) -> None:
        self.ids = suite_identities(zone, workers)
        self.token_files = provision(rd / "auth", list(self.ids.values()))
        self.accepted = accepted_file(rd / "auth")
        self.pki: DevPki | None = make_dev_pki(rd / "pki", list(self.ids.values())) if tls else None

    def flags(self, name: str) -> list[str]:
        ident = self.ids[name]
        out = ["--auth-mode", "enforce", "--auth-tokens-file", str(self.accepted)]
        out += ["--auth-token-file", str(self.token_files[ident])]
        if self.pki is not None:
            pair, ca = self.pki.pairs[ident], str(self.pki.ca)
            out += ["--tls-cert", str(pair.cert), "--tls-key", str(pair.key), "--tls-client-ca", ca, "--tls-ca", ca]
            out += ["--tls-client-cert", str(pair.cert), "--tls-client-key", str(pair.key)]
        return out

    def credentials(self, name: str = "admin") -> grpc.ChannelCredentials | None:
        return _credentials(self.state(), name)

    def state(self) -> dict[str, Any]:
        """What the state file records: the operator's and the demo client's token and certificate files."""
        out: dict[str, Any] = {
            "tokens": {n: str(self.token_files[self.ids[n]]) for n in ("admin", "client")},
            "tls": None,
        }
        if self.pki is not None:
            pairs = {n: self.pki.pairs[self.ids[n]] for n in ("admin", "client")}
            out["tls"] = {"ca": str(self.pki.ca), **{n: [str(p.cert), str(p.key)] for n, p in pairs.items()}}
        return out


def _credentials(auth: dict[str, Any] | None, name: str) -> grpc.ChannelCredentials | None:
    """mTLS credentials of `name` (admin or client) from a suite's auth state; None for a plaintext suite."""
    tls = (auth or {}).get("tls")
    if not tls:
        return None
    cert, key = tls[name]
    return grpc.ssl_channel_credentials(Path(tls["ca"]).read_bytes(), Path(key).read_bytes(), Path(cert).read_bytes())


def _suite_channel(address: str, auth: dict[str, Any] | None, name: str) -> grpc.Channel:
    creds = _credentials(auth, name)
    return grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)


def up(args: argparse.Namespace) -> int:
    rd = run_dir()
    if _state_path().exists() and _alive(json.loads(_state_path().read_text())):
        print(f"a suite is already running (state in {_state_path()}); `kvmesh down` first", file=sys.stderr)
        return 1
    rd.mkdir(parents=True, exist_ok=True)
    logs = rd / "logs"
    started: list[ServiceProcess] = []
    redis_proc: subprocess.Popen[bytes] | None = None
    common = ("--zone", args.zone, "--log-level", args.log_level)
    auth = SuiteAuth(rd, args.zone, args.workers, args.tls)
    creds = auth.credentials()
    try:
        cm_flags = [
            *common,
            "--block-size",
            str(args.block_size),
            "--checkpoint-dir",
            str(rd / "checkpoints"),
            "--model",
            args.salt_model,
        ]  # the index hash salt's model string, equal to the router's
        if args.redis:
            redis_proc, url = _start_redis(rd / "redis")
            cm_flags += ["--redis-url", url]
        cache = start_service(
            "cache-manager", logs, *cm_flags, *auth.flags("cache-manager"), timeout=60, credentials=creds
        )
        started.append(cache)
        timeout = 300 if args.engine == "vllm" else 60
        workers = []
        worker_env = vllm_core_env(args.workers) if args.engine == "vllm" else [{}] * args.workers
        for i in range(args.workers):
            flags = [
                *common,
                *auth.flags(f"worker-{args.zone}-{i}"),
                "--service-id",
                f"worker-{args.zone}-{i}",
                "--engine",
                args.engine,
                "--block-size",
                str(args.block_size),
                "--cache-manager",
                cache.address,
            ]
            if args.model:
                flags += ["--model", args.model]
            workers.append(start_service("worker", logs, *flags, env=worker_env[i], timeout=timeout, credentials=creds))
        started.extend(workers)
        r_flags = [
            *common,
            *auth.flags("router"),
            "--block-size",
            str(args.block_size),
            "--cache-manager",
            cache.address,
            "--workers",
            ",".join(w.address for w in workers),
            "--salt-model",
            args.salt_model,
        ]
        if args.model:
            r_flags += ["--model", args.model]
        if args.engine == "vllm":  # the router checks token ids against the model's own vocabulary
            r_flags += ["--vocab-size", "0"]
        router = start_service("router", logs, *r_flags, timeout=120, credentials=creds)
        started.append(router)
        registry = rd / "registry.yaml"
        _write_registry(registry, started)
        fo_flags = [*common, *auth.flags("failover"), "--registry-file", str(registry)]
        failover = start_service(
            "failover", logs, *fo_flags, "--lkg-file", str(rd / "lkg.json"), timeout=60, credentials=creds
        )
        started.append(failover)
    except BaseException:
        for sp in reversed(started):
            sp.kill()
        if redis_proc is not None:
            redis_proc.kill()
        raise
    state = {
        "services": [
            {
                "name": p.name,
                "id": p.info["id"],
                "pid": p.proc.pid,
                "grpc": p.address,
                "http_port": p.info["http_port"],
                "log": str(p.log_path),
            }
            for p in started
        ],
        "redis_pid": redis_proc.pid if redis_proc else None,
        "auth": auth.state(),
    }
    _state_path().write_text(json.dumps(state, indent=1))
    _print_endpoints(state)
    admin_token = auth.state()["tokens"]["admin"]
    print(f"  admin token    {admin_token}" + ("  (mTLS: certificates in run/pki)" if args.tls else ""))
    if args.detach:
        print("suite running in the background; `kvmesh status`, `kvmesh demo`, `kvmesh down`")
        return 0
    # Handlers, not a signal mask: gRPC's threads would take a process-directed signal that only the main
    # thread blocks. Installed before announcing Ctrl-C, so a signal right after the line is never lost.
    stop = threading.Event()

    def on_signal(_signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print("press Ctrl-C to stop", flush=True)
    while not stop.is_set() and all(p.proc.poll() is None for p in started):
        stop.wait(1.0)  # the timeout only serves to notice a dead service
    dead = [p.name for p in started if p.proc.poll() is not None]
    if dead:
        print(f"stopping: {', '.join(dead)} exited", file=sys.stderr)
    return _stop_state(state)


def _print_endpoints(state: dict[str, Any]) -> None:
    for s in state["services"]:
        print(f"  {s['name']:<14} {s['id']:<24} grpc {s['grpc']:<22} http 127.0.0.1:{s['http_port']}")


def _alive(state: dict[str, Any]) -> bool:
    for s in state.get("services", []):
        try:
            os.kill(int(s["pid"]), 0)
            return True
        except OSError:
            continue
    return False


def _stop_state(state: dict[str, Any]) -> int:
    """SIGTERM every service in reverse start order and wait for each (bounded), then SIGKILL stragglers."""
    worst = 0
    pids = [int(s["pid"]) for s in reversed(state["services"])]
    if state.get("redis_pid"):
        pids.append(int(state["redis_pid"]))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # not our child (detached suite): poll for existence
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
                continue
            if done:
                worst = max(worst, os.waitstatus_to_exitcode(status))
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            worst = max(worst, 1)
    _state_path().unlink(missing_ok=True)
    print("suite stopped" + ("" if worst == 0 else f" (a service exited with {worst})"))
    return 0 if worst == 0 else 1


def status(_args: argparse.Namespace) -> int:
    if not _state_path().exists():
        print("no suite is running (kvmesh up)")
        return 1
    state = json.loads(_state_path().read_text())
    ok = True
    for s in state["services"]:
        try:
            with _suite_channel(s["grpc"], state.get("auth"), "admin") as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
            text = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as err:
            text = f"UNREACHABLE ({err.code().name})"
        ok &= text == "SERVING"
        print(f"  {s['name']:<14} {s['id']:<24} {s['grpc']:<22} {text}")
    return 0 if ok else 1


def down(_args: argparse.Namespace) -> int:
    if not _state_path().exists():
        print("no suite is running")
        return 0
    return _stop_state(json.loads(_state_path().read_text()))


def demo(args: argparse.Namespace) -> int:
    from kvmesh.v1 import router_pb2, router_pb2_grpc

    if not _state_path().exists():
        print("no suite is running (kvmesh up --detach)", file=sys.stderr)
        return 1
    state = json.loads(_state_path().read_text())
    router = next(s for s in state["services"] if s["name"] == "router")
    req = router_pb2.RouterServiceGenerateRequest(text=args.prompt, session_id="demo")
    req.sampling.max_tokens = args.max_tokens
    started = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    final = None
    with _suite_channel(router["grpc"], state.get("auth"), "client") as ch:
        for msg in router_pb2_grpc.RouterServiceStub(ch).Generate(req, timeout=120):
            first = first if first is not None else time.perf_counter()
            pieces.append(msg.text)
            final = msg
    assert final is not None
    print(f"prompt: {args.prompt!r}")
    print(f"completion ({final.worker_id}): {''.join(pieces)!r}")
    print(
        f"usage: prompt={final.usage.prompt_tokens} cached={final.usage.cached_tokens} "
        f"completion={final.usage.completion_tokens}; ttft {1000 * ((first or started) - started):.1f} ms, "
        f"total {1000 * (time.perf_counter() - started):.1f} ms"
    )
    return 0


def certs(args: argparse.Namespace) -> int:
    """`kvmesh certs DIR`: the CA and one pair per identity `kvmesh up` would use (docs/security.md)."""
    hosts = ("localhost", "127.0.0.1", *args.host)
    pki = make_dev_pki(args.directory, list(suite_identities(args.zone, args.workers).values()), hosts)
    print(f"CA: {pki.ca} (key {pki.ca.with_suffix('.key')}, mode 0600)")
    for ident, pair in pki.pairs.items():
        print(f"  {ident.spiffe_id:<44} {pair.cert}  {pair.key}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from kvmesh.bench.__main__ import main as bench_main

        return int(bench_main(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start the whole suite locally")
    p_up.add_argument("--workers", type=int, default=2)
    p_up.add_argument("--engine", choices=("sim", "vllm"), default="sim")
    p_up.add_argument("--model", default="", help="model folder (default: the tiny local model)")
    p_up.add_argument("--block-size", type=int, default=32)
    p_up.add_argument(
        "--salt-model",
        default="",
        help="model string of the KV index hash salt, given to the "
        "cache-manager (--model) and the router (--salt-model) alike",
    )
    p_up.add_argument("--zone", default="local")
    p_up.add_argument("--redis", action="store_true", help="checkpoints in a local redis-server")
    p_up.add_argument("--detach", action="store_true", help="leave the suite running and return")
    p_up.add_argument("--tls", action="store_true", help="mTLS everywhere, identities from a development CA")
    p_up.add_argument("--log-level", default="INFO")
    p_up.set_defaults(func=up)
    sub.add_parser("status", help="health of the running suite").set_defaults(func=status)
    sub.add_parser("down", help="stop a detached suite").set_defaults(func=down)
    p_demo = sub.add_parser("demo", help="send one real request through the router")
    p_demo.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. Tell me a story")
    p_demo.add_argument("--max-tokens", type=int, default=24)
    p_demo.set_defaults(func=demo)
    p_certs = sub.add_parser("certs", help="a development CA and a certificate per service and role")
    p_certs.add_argument("directory", type=Path)
    p_certs.add_argument("--zone", default="local")
    p_certs.add_argument("--workers", type=int, default=2)
    p_certs.add_argument("--host", action="append", default=[], help="extra DNS name / IP of the servers")
    p_certs.set_defaults(func=certs)
    sub.add_parser("bench", help="benchmarks: kvmesh bench <index|worker|router|fleet|failover> ...")
    admin_cli.register(sub)  # workers, rebalance, drain, undrain, zones, weights, index, top
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
