"""`kvmesh`: the umbrella command.

    kvmesh up [--config FILE] [--set K=V] [--ports auto] [--workers N] [--engine sim|vllm] [--detach] ...
                                                                       start the whole suite locally
    kvmesh up --prefill-workers N --decode-workers M ...               the same, prefill/decode disaggregated
    kvmesh status                                                      health of every service of the suite
    kvmesh demo [--prompt TEXT] [--api-key KEY | --token-file FILE]    one real request through the router
    kvmesh down                                                        stop a detached (or still starting) suite
    kvmesh logs [SERVICE] [--zone Z] [--follow] [--last]               the suite's service logs (this run's)
    kvmesh certs DIR [--zone Z] [--workers N]                          a development CA and certificates
    kvmesh bench NAME ...                                              a benchmark (python -m kvmesh.bench --help)

`up` starts each service as its own process with embedded defaults: a static registry file instead of Consul
(the failover service probes its instances' gRPC health: a killed service leaves the endpoint sets in seconds),
file checkpoints instead of Redis (unless --redis), simulated workers unless --engine vllm (real vLLM on the
CPU with the tiny local model). State lives in `$KVMESH_HOME/run` (default `./var/run`): `suite.json` from the
moment `up` starts (`status` and `down` see a suite that is still starting), this run's logs, checkpoints and
planner history in `run/current`, the previous run's in `run/last` (`kvmesh.suite.runs`). `up` prints each
service as it becomes ready, and what it still waits for while engines load. Its ports, zones and the rest:
`kvmesh up --help` and `kvmesh.suite.config` (the router's OpenAI API is on port 8000).

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
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.core.errors import FailedPrecondition, KvmeshError
from kvmesh.rpc.channel import ChannelSecurity
from kvmesh.rpc.tls import channel_credentials, client_ssl_context
from kvmesh.security.certs import make_dev_pki
from kvmesh.suite import admin as admin_cli
from kvmesh.suite import config as suite_config
from kvmesh.suite import local as suite
from kvmesh.suite import observe, runs
from kvmesh.suite.admin import target as admin_target
from kvmesh.suite.failures import explain
from kvmesh.suite.local import run_dir, state_path, suite_identities

_Raw = argparse.RawDescriptionHelpFormatter
UP_HELP = """Start the whole suite locally: per zone a cache-manager, workers, a router and a failover service.

Ports (fixed by default; zone k adds 100 k, worker i adds i; --ports auto: every one picks a free port):
  service         gRPC    HTTP                                  key of --config / --set
  router          50051   8000 (OpenAI API, /metrics)           router.grpcPort, router.httpPort
  cache-manager   50052   51052 (/metrics)                      cacheManager.grpcPort, .httpPort
  failover        50053   51053 (/metrics)                      failover.grpcPort, .httpPort
  worker i        50060+i 51060+i (/metrics, OpenAI API)        worker.grpcPort, .httpPort
  worker i kv-sync 52060+i                                      worker.kvSyncPort
  redis-server    50050   (with --redis)                        redis.port
A port in use stops `up` before anything starts, naming the port and the flag that moves it.

--config FILE: the suite in one YAML file, in the Helm values' shape (docs/examples/); --set KEY=VALUE
changes one of its keys; the named flags win over both."""


def _read_state() -> dict[str, Any]:
    """The running suite's state file; FailedPrecondition naming it when it is not the JSON `up` writes."""
    path = state_path()
    try:
        state = json.loads(path.read_text())
    except ValueError as err:
        raise FailedPrecondition(
            f"the suite state {path} is not JSON ({err}): once no kvmesh service of it runs, remove it"
        ) from None
    if not isinstance(state, dict) or not isinstance(state.get("services"), list):
        raise FailedPrecondition(f"the suite state {path} is not a suite's (no services list): remove it")
    return state


def _credentials(auth: dict[str, Any] | None, name: str) -> grpc.ChannelCredentials | None:
    """mTLS credentials of `name` (admin or client) from a suite's auth state; None for a plaintext suite."""
    tls = (auth or {}).get("tls")
    if not tls:
        return None
    cert, key = tls[name]
    return channel_credentials(tls["ca"], cert, key)


def _suite_channel(address: str, auth: dict[str, Any] | None, name: str) -> grpc.Channel:
    creds = _credentials(auth, name)
    return grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)


def up(args: argparse.Namespace) -> int:
    if args.workers is not None and (args.prefill_workers is not None or args.decode_workers is not None):
        print(
            "kvmesh up: --workers: give either --workers N (aggregated) or --prefill-workers N --decode-workers M"
            " (disaggregated), not both",
            file=sys.stderr,
        )
        return 2
    try:
        settings = suite_config.load(args.config, args.set, _flag_overrides(args))
    except suite_config.ConfigError as err:
        flag = _flag_of(args, err.path)
        where = f"{args.config}: " if args.config and not flag else ""
        print(f"kvmesh up: {where}{f'{flag}: {err.message}' if flag else err}", file=sys.stderr)
        return 2
    rd = run_dir()
    if state_path().exists() and _alive(_read_state()):
        print(f"a suite is already running (state in {state_path()}); `kvmesh down` first", file=sys.stderr)
        return 1
    if args.observe:
        try:
            observe.check_port(args.prometheus_port)
        except FailedPrecondition as err:
            print(f"kvmesh up: nothing started: --observe: {err}", file=sys.stderr)
            return 1
    rd.mkdir(parents=True, exist_ok=True)
    run = runs.open_run()  # this run's logs, checkpoints, planner history (the previous run's: run/last)
    progress = runs.StartProgress(state_path(), run)  # `status` and `down` see the suite from here on
    print(f"starting the suite (state {state_path()}, logs {run / 'logs'})", flush=True)
    restore = runs.terminate_on_sigterm()  # `kvmesh down` while starting: stop what was started, then exit
    try:
        started = runs.start_interruptibly(lambda: suite.start(settings, rd, run, watch=progress), progress)
    except suite.PortsInUse as err:
        progress.abandon()
        runs.discard_run()
        print(f"kvmesh up: nothing started:\n{err}", file=sys.stderr)
        return 1
    except (RuntimeError, TimeoutError) as err:  # a service that did not start: the others were stopped
        progress.abandon()
        runs.close_run(progress.state)
        print(f"kvmesh up: {err}\nkvmesh up: every service it had started was stopped", file=sys.stderr)
        print("kvmesh up: this start's logs: kvmesh logs --last", file=sys.stderr)
        return 1
    except (runs.Interrupted, KeyboardInterrupt):  # every service it had started was stopped
        progress.abandon()
        runs.close_run(progress.state)
        print("kvmesh up: interrupted while starting: every service it had started was stopped", file=sys.stderr)
        return 130
    except BaseException:  # e.g. no model for vLLM workers (SystemExit): nothing runs, so no state either
        progress.abandon()
        runs.close_run(progress.state)
        raise
    finally:
        restore()
    auth = started.auth
    roles = suite.worker_roles(settings)
    state: dict[str, Any] = {
        "services": [
            {
                "name": p.name,
                "id": p.info["id"],
                "pid": p.proc.pid,
                "grpc": p.address,
                "http_port": p.info["http_port"],
                "http_scheme": p.info.get("http_scheme", "http"),
                "zone": p.info.get("zone", ""),
                "log": str(p.log_path),
            }
            | ({"processes": p.info["processes"]} if "processes" in p.info else {})
            | ({"worker_role": roles[p.info["id"]]} if p.info["id"] in roles else {})
            for p in started.services
        ],
        "redis_pid": started.redis.pid if started.redis else None,
        "auth": auth.state(),
        "run_dir": str(run),
    }
    prom: observe.Prometheus | None = None
    if args.observe:  # a real Prometheus scraping the suite, deploy/'s alert rules loaded (kvmesh.suite.observe)
        try:
            prom = observe.start(run / "prometheus", state, port=args.prometheus_port)
            state["prometheus"] = vars(prom)
        except FailedPrecondition as err:
            print(f"--observe: {err}", file=sys.stderr)
            _stop_state(state)
            return 1
    progress.finish(state)
    _print_endpoints(state)
    if prom is not None:
        print(f"  prometheus     {prom.url}  (config {prom.config})")
    admin_token = auth.state()["tokens"]["admin"]
    print(f"  admin token    {admin_token}" + ("  (mTLS: certificates in run/pki)" if settings.tls.enabled else ""))
    for z in settings.zones:
        router = next(x for x in state["services"] if x["name"] == "router" and x["zone"] == z.name)
        print(f"  OpenAI API     {router['http_scheme']}://127.0.0.1:{router['http_port']}/v1  (zone {z.name})")
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
    procs = started.services
    while not stop.is_set() and all(p.proc.poll() is None for p in procs):
        stop.wait(1.0)  # the timeout only serves to notice a dead service
    dead = [p.info.get("id", p.name) for p in procs if p.proc.poll() is not None]
    if dead:
        print(f"stopping: {', '.join(dead)} exited", file=sys.stderr)
    return _stop_state(state)


def _print_endpoints(state: dict[str, Any]) -> None:
    for s in state["services"]:
        print(f"  {s['name']:<14} {s['id']:<28} grpc {s['grpc']:<17} http 127.0.0.1:{s['http_port']}")


def _alive(state: dict[str, Any]) -> bool:
    """Some process of the suite runs: a service, one still starting, or the `up` that starts them."""
    pids = [s["pid"] for s in [*state.get("services", []), *state.get("starting", [])]]
    pids += [state["launcher_pid"]] if state.get("launcher_pid") else []
    return any(runs.alive(int(pid)) for pid in pids)


def _stop_state(state: dict[str, Any]) -> int:
    """SIGTERM every service in reverse start order (those still starting first), one line each, waiting for each
    (bounded) before SIGKILL; then the run is closed (its logs kept in run/last)."""
    if state.get("prometheus"):
        observe.stop(int(state["prometheus"]["pid"]))
    entries = [*reversed(state.get("starting", [])), *reversed(state["services"])]
    if state.get("redis_pid"):
        entries.append({"name": "redis-server", "pid": state["redis_pid"]})
    worst = runs.stop_services(entries)
    state_path().unlink(missing_ok=True)
    last = runs.close_run(state)
    kept = f"; its logs: kvmesh logs --last ({last / 'logs'})" if last is not None else ""
    print("suite stopped" + ("" if worst == 0 else f" (a service exited with {worst})") + kept)
    return 0 if worst == 0 else 1


def status(_args: argparse.Namespace) -> int:
    if not state_path().exists():
        print("no suite is running (kvmesh up)")
        return 1
    state = _read_state()
    ok = state.get("state", "running") == "running"
    if not ok:  # `up` is still starting it: what serves already, and what it waits for
        since = time.time() - float(state.get("started_at", time.time()))
        launcher = int(state.get("launcher_pid") or 0)
        if launcher and runs.alive(launcher):
            print(f"suite starting for {since:.0f}s (kvmesh up, pid {launcher}); their logs: `kvmesh logs`")
        else:
            print(f"suite start did not finish: its `kvmesh up` (pid {launcher}) is gone; `kvmesh down` stops the rest")
    for s in state["services"]:
        try:
            with _suite_channel(s["grpc"], state.get("auth"), "admin") as ch:
                reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
            text = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        except grpc.RpcError as err:
            text = f"UNREACHABLE ({err.code().name})"
        ok &= text == "SERVING"
        print(f"  {s['name']:<14} {s['id']:<28} {s['grpc']:<22} {text}")
    for s in state.get("starting", []):
        waited = time.time() - float(s["since"])
        print(f"  {s['name']:<14} {s['label']:<28} {'-':<22} STARTING ({waited:.0f}s, pid {s['pid']})")
    return 0 if ok else 1


def down(_args: argparse.Namespace) -> int:
    if not state_path().exists():
        print("no suite is running")
        return 0
    state = _read_state()
    launcher = int(state.get("launcher_pid") or 0)
    if state.get("state") == "starting" and launcher and runs.alive(launcher):
        # its `up` stops what it started and removes the state; what it recorded is checked after it
        print(f"the suite is still starting: stopping its `kvmesh up` (pid {launcher}) first", flush=True)
        how, _ = runs.stop_pid(launcher, group=False)
        print(f"  {how:<10} kvmesh up (pid {launcher})", flush=True)
        if not state_path().exists():
            entries = [*reversed(state.get("starting", [])), *reversed(state["services"])]
            worst = runs.stop_services(entries, gone_as="stopped by kvmesh up")
            print("suite stopped; its logs: kvmesh logs --last")
            return 0 if worst == 0 else 1
        state = _read_state()
    return _stop_state(state)


def demo(args: argparse.Namespace) -> int:
    """One request through the router over gRPC, then the same prompt through its OpenAI API (a local suite's
    router: HTTPS verified with the suite's CA when it runs TLS), both with the suite's client credential
    (its token; on a --tls suite also its certificate, which then names the caller) unless flags give one."""
    from kvmesh.v1 import router_pb2, router_pb2_grpc

    target = admin_target.resolve(args, "router", who="client")
    assert target is not None  # required
    sec = target.security
    req = router_pb2.RouterServiceGenerateRequest(text=args.prompt, session_id="demo")
    req.sampling.max_tokens = args.max_tokens
    metadata = (("authorization", f"Bearer {sec.token}"),) if sec.token else ()
    creds = sec.credentials()
    started = time.perf_counter()
    first: float | None = None
    pieces: list[str] = []
    final = None
    with grpc.secure_channel(target.address, creds) if creds else grpc.insecure_channel(target.address) as ch:
        for msg in router_pb2_grpc.RouterServiceStub(ch).Generate(req, timeout=args.timeout, metadata=metadata):
            first = first if first is not None else time.perf_counter()
            pieces.append(msg.text)
            final = msg
    if final is None:
        raise KvmeshError(f"the router at {target.address} ended the stream without an answer")
    print(f"prompt: {args.prompt!r}")
    print(f"completion ({final.worker_id}): {''.join(pieces)!r}")
    print(
        f"usage: prompt={final.usage.prompt_tokens} cached={final.usage.cached_tokens} "
        f"completion={final.usage.completion_tokens}; ttft {1000 * ((first or started) - started):.1f} ms, "
        f"total {1000 * (time.perf_counter() - started):.1f} ms"
    )
    url = _openai_url(target)
    if url:  # a router given by address: its HTTP port is not known
        _openai_demo(f"{url}/completions", sec, args)
    return 0


def _openai_url(target: admin_target.Target) -> str:
    """The OpenAI API of a local suite's router (`kvmesh up` recorded its HTTP port and scheme); "" for a router
    given by address."""
    if target.source in ("flag", "env"):
        return ""
    state = _read_state()
    router = next(s for s in state["services"] if s["name"] == "router" and s["grpc"] == target.address)
    return f"{router.get('http_scheme', 'http')}://127.0.0.1:{router['http_port']}/v1"


def _openai_demo(url: str, sec: ChannelSecurity, args: argparse.Namespace) -> None:
    """The demo's prompt as `POST /v1/completions` (urllib: the CLI's one HTTP client), its answer printed."""
    body = json.dumps({"prompt": args.prompt, "max_tokens": args.max_tokens, "user": "demo"}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    if sec.token:
        request.add_header("Authorization", f"Bearer {sec.token}")
    tls = client_ssl_context(sec.tls_ca, sec.tls_client_cert, sec.tls_client_key) if sec.tls_ca else None
    with urllib.request.urlopen(request, timeout=args.timeout, context=tls) as reply:
        answer = json.loads(reply.read())
    usage = answer["usage"]
    print(f"OpenAI API {url}: {answer['choices'][0]['text']!r}")
    print(
        f"usage: prompt={usage['prompt_tokens']} cached={usage['prompt_tokens_details']['cached_tokens']} "
        f"completion={usage['completion_tokens']}"
    )


def certs(args: argparse.Namespace) -> int:
    """`kvmesh certs DIR`: the CA and one pair per identity `kvmesh up` would use (docs/security.md)."""
    hosts = ("localhost", "127.0.0.1", *args.host)
    pki = make_dev_pki(args.directory, list(suite_identities(args.zone, args.workers).values()), hosts)
    print(f"CA: {pki.ca} (key {pki.ca.with_suffix('.key')}, mode 0600)")
    for ident, pair in pki.pairs.items():
        print(f"  {ident.spiffe_id:<44} {pair.cert}  {pair.key}")
    return 0


# `kvmesh up`'s flags that name one setting of kvmesh.suite.config (flag dest -> key path); None = not given
UP_FLAGS = {
    "workers": "worker.replicas",
    "prefill_workers": "worker.prefillReplicas",
    "decode_workers": "worker.decodeReplicas",
    "engine": "worker.engine",
    "model": "model.path",
    "block_size": "model.blockSize",
    "salt_model": "model.salt",
    "zone": "zone",
    "redis": "redis.enabled",
    "tls": "tls.enabled",
    "log_level": "logLevel",
    "http_port": "router.httpPort",
    "grpc_port": "router.grpcPort",
}


def _flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    out = {key: getattr(args, dest) for dest, key in UP_FLAGS.items()}
    out["ports.auto"] = None if args.ports is None else args.ports == "auto"
    if args.workers is not None:  # aggregated workers win over a file's prefill/decode pools, as flags do
        out |= {UP_FLAGS["prefill_workers"]: 0, UP_FLAGS["decode_workers"]: 0}
    return out


def _flag_of(args: argparse.Namespace, path: str) -> str:
    """The named flag (`--prefill-workers`) a bad setting's key path came from, when it was given; else ""."""
    for dest, key in UP_FLAGS.items():
        if path == key and getattr(args, dest) is not None:
            return "--" + dest.replace("_", "-")
    return ""


def add_up_parser(sub: Any) -> argparse.ArgumentParser:
    """`kvmesh up`: every flag defaults to None (not given), so that the config file's value stands."""
    p = sub.add_parser("up", help="start the whole suite locally", description=UP_HELP, formatter_class=_Raw)
    p.add_argument("--config", type=Path, help="the suite in one YAML file (docs/examples/, Helm values' shape)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one setting of the file, e.g. --set zones[1].worker.replicas=3 (a YAML value); flags below win over it",
    )
    p.add_argument(
        "--ports",
        choices=("fixed", "auto"),
        help="fixed: the documented ports (default); "
        "auto: every service picks a free port (suites side by side, tests)",
    )
    p.add_argument("--http-port", type=int, help="the router's OpenAI HTTP port (default 8000; zone k: + 100 k)")
    p.add_argument("--grpc-port", type=int, help="the router's gRPC port (default 50051; zone k: + 100 k)")
    p.add_argument("--workers", type=int, help="workers per zone (default 2)")
    p.add_argument(
        "--prefill-workers",
        type=int,
        metavar="N",
        help="prefill/decode disaggregation: N workers of role prefill per zone (with --decode-workers)",
    )
    p.add_argument(
        "--decode-workers", type=int, metavar="M", help="M workers of role decode per zone (in place of --workers)"
    )
    p.add_argument("--engine", choices=("sim", "vllm"), help="worker engine (default sim)")
    p.add_argument("--model", help="model folder (default: the tiny local model)")
    p.add_argument("--block-size", type=int, help="tokens per KV block (default 32)")
    p.add_argument(
        "--salt-model",
        help="model string of the KV index hash salt, given to the cache-manager "
        "(--model) and the router (--salt-model) alike (default '')",
    )
    p.add_argument("--zone", help="name of the one zone (default local)")
    p.add_argument("--redis", action="store_const", const=True, help="checkpoints in a local redis-server")
    p.add_argument("--tls", action="store_const", const=True, help="mTLS everywhere, identities from a dev CA")
    p.add_argument("--log-level", help="DEBUG, INFO (default), WARNING, ERROR")
    p.add_argument("--detach", action="store_true", help="leave the suite running and return")
    p.add_argument("--observe", action="store_true", help="also start a local Prometheus scraping the suite")
    p.add_argument("--prometheus-port", type=int, default=observe.DEFAULT_PORT, help="--observe's Prometheus")
    p.set_defaults(func=up)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The `kvmesh` command's whole parser, every subcommand and flag (tests parse the docs' commands with it)."""
    parser = argparse.ArgumentParser(prog="kvmesh", description=__doc__.split("\n\n")[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True)
    add_up_parser(sub)
    sub.add_parser("status", help="health of the running suite").set_defaults(func=status)
    sub.add_parser("down", help="stop a detached suite").set_defaults(func=down)
    runs.add_logs_parser(sub)
    p_demo = sub.add_parser(
        "demo",
        help="send one real request through the router (gRPC, then its OpenAI API)",
        description="One request through the local suite's router (or --router), with the suite's client "
        "credential unless a flag gives one (a router API key, or a role token file).",
    )
    p_demo.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. Tell me a story")
    p_demo.add_argument("--max-tokens", type=int, default=24)
    p_demo.add_argument("--router", metavar="HOST:PORT", help="router gRPC address (env KVMESH_ROUTER)")
    cred = p_demo.add_mutually_exclusive_group()
    cred.add_argument("--api-key", help="router API key to send (env KVMESH_API_KEY)")
    cred.add_argument("--token-file", help="file holding a role token to send (env KVMESH_TOKEN_FILE)")
    cred.add_argument("--token", help="role token to send (env KVMESH_TOKEN)")
    p_demo.add_argument("--ca", help="CA to verify the router with: TLS (env KVMESH_CA)")
    p_demo.add_argument("--cert", help="client certificate for mTLS (env KVMESH_CERT)")
    p_demo.add_argument("--key", help="client key for mTLS (env KVMESH_KEY)")
    p_demo.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default 120)")
    p_demo.set_defaults(func=demo)
    p_certs = sub.add_parser("certs", help="a development CA and a certificate per service and role")
    p_certs.add_argument("directory", type=Path)
    p_certs.add_argument("--zone", default="local")
    p_certs.add_argument("--workers", type=int, default=2)
    p_certs.add_argument("--host", action="append", default=[], help="extra DNS name / IP of the servers")
    p_certs.set_defaults(func=certs)
    sub.add_parser("bench", help="a benchmark: kvmesh bench NAME ... (the names: python -m kvmesh.bench --help)")
    admin_cli.register(sub)  # workers, drain, zones, weights, index, warming, guardrails, planner, top, ...
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # the benchmarks are a tool, not part of the suite: run as their own program, never imported here
        os.execv(sys.executable, [sys.executable, "-m", "kvmesh.bench", *argv[1:]])
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # every failure is one line naming cause and fix, never a traceback
        line, code = explain(exc)
        print(f"kvmesh {args.command}: {line}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
