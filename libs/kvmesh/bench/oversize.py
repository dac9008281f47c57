"""``python -m kvmesh.bench oversize``: what an oversize prompt costs the router (input hardening: limits before work).

Starts a real sim worker and router (default limits: 131072 prompt tokens, 8 MiB HTTP bodies) and sends
- HTTP: a 7.8 MB text prompt (under the body cap, far over what 131072 tokens can cover);
- gRPC: 20 MB of text (over the Generate message bound: refused on its size before decoding), 40 MB (over
  the transport's backstop, twice that bound: refused by grpc-core), and 16 MB (under the bound, refused by
  the character check before tokenising);
then a normal request, to show the router still serves. For scale, `http_7.8MB_transfer_only` is the same
body with an unknown field first, refused right after JSON parsing: what receiving and parsing 7.8 MB costs
whatever the checks; `bare_grpc_20MB` is 20 MB sent to a bare grpc.aio server (`bench grpc-hop`'s echo
server: another process, no kvmesh code) with a receive limit under it (grpc-core refuses it) and over it
(accepted, answered at once), best of 3. For each router row: the answer (status / code), its latency
(client side, sending included), and the router's memory growth (its high-water RSS, `VmHWM` of
/proc/<pid>/status, after the request minus its RSS before). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import httpx

from kvmesh.bench.grpc_hop import METHOD as HOP_METHOD
from kvmesh.bench.grpc_hop import start_echo_server
from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

MB = 1_000_000


def proc_kib(pid: int, key: str) -> int:
    """A `/proc/<pid>/status` figure in KiB (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def measured(pid: int, send: Callable[[], str]) -> dict[str, Any]:
    """Runs `send` (returns the answer) and reports its latency and the router's memory growth."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS: each row its own peak
    rss0 = proc_kib(pid, "VmRSS")
    t0 = time.perf_counter()
    answer = send()
    ms = (time.perf_counter() - t0) * 1000
    growth = max(0, proc_kib(pid, "VmHWM") - rss0)
    return {"answer": answer, "latency_ms": round(ms, 1), "rss_growth_mb": round(growth / 1024, 1)}


def http_prompt(router: ServiceProcess, n_bytes: int, extra: dict[str, Any] | None = None) -> Callable[[], str]:
    body = json.dumps((extra or {}) | {"prompt": "ab " * (n_bytes // 3), "max_tokens": 2}).encode()

    def send() -> str:
        r = httpx.post(f"http://127.0.0.1:{router.http_port}/v1/completions", content=body, timeout=120)
        return f"{r.status_code} {r.json()['error']['param'] if r.status_code >= 400 else ''}".strip()

    return send


def grpc_text(stub: router_pb2_grpc.RouterServiceStub, n_bytes: int) -> Callable[[], str]:
    req = router_pb2.RouterServiceGenerateRequest(
        text="ab " * (n_bytes // 3), sampling=common_pb2.SamplingParams(max_tokens=2)
    )

    def send() -> str:
        try:
            list(stub.Generate(req, timeout=120))
        except grpc.RpcError as e:
            return str(e.code().name)
        return "OK"

    return send


def bare_grpc(tmp: Path, n_bytes: int, limit: int) -> dict[str, Any]:
    """Best of 3: `n_bytes` sent to a bare grpc.aio server (`bench grpc-hop`'s echo) with receive limit `limit`."""
    server, port = start_echo_server(tmp / f"bare-{limit}.port", max_receive_bytes=limit)
    try:
        opts = [("grpc.max_send_message_length", 64 << 20)]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            call = ch.unary_stream(HOP_METHOD)
            list(call(b"warm", timeout=30))
            body, answer, best = b"a" * n_bytes, "", float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                try:
                    list(call(body, timeout=60))
                    answer = "OK"
                except grpc.RpcError as e:
                    answer = str(e.code().name)
                best = min(best, (time.perf_counter() - t0) * 1000)
        return {"limit_mb": round(limit / MB, 1), "answer": answer, "best_latency_ms": round(best, 1)}
    finally:
        server.kill()
        server.wait(timeout=10)


def run(tmp: Path) -> dict[str, Any]:
    worker = start_service("worker", tmp / "w", "--engine", "sim", "--sim-speed", "0", timeout=60)
    router = start_service("router", tmp / "r", "--workers", worker.address, timeout=60)
    try:
        pid = router.proc.pid
        opts = [("grpc.max_send_message_length", 64 << 20)]
        with grpc.insecure_channel(router.address, options=opts) as ch:
            stub = router_pb2_grpc.RouterServiceStub(ch)
            ok = router_pb2.RouterServiceGenerateRequest(
                text="hello world", sampling=common_pb2.SamplingParams(max_tokens=2)
            )
            list(stub.Generate(ok, timeout=30))  # warm: imports and first-call costs are not the prompt's
            http_prompt(router, 1000)()
            out: dict[str, Any] = {"bench": "oversize", "router_rss_mb": round(proc_kib(pid, "VmRSS") / 1024, 1)}
            out["http_7.8MB_transfer_only"] = measured(pid, http_prompt(router, int(7.8 * MB), {"unknown": 1}))
            out["http_7.8MB_prompt"] = measured(pid, http_prompt(router, int(7.8 * MB)))
            out["grpc_20MB_text"] = measured(pid, grpc_text(stub, 20 * MB))
            out["grpc_40MB_text"] = measured(pid, grpc_text(stub, 40 * MB))
            out["grpc_16MB_text"] = measured(pid, grpc_text(stub, 16 * MB))
            out["after_normal_request"] = measured(pid, lambda: str(len(list(stub.Generate(ok, timeout=30)))))
    finally:
        router.terminate(timeout=30)
        worker.terminate(timeout=30)
    out["bare_grpc_20MB"] = [bare_grpc(tmp, 20 * MB, limit) for limit in (17 << 20, 64 << 20)]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m kvmesh.bench oversize", description=__doc__).parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-oversize-") as tmp:
        print(json.dumps(run(Path(tmp))))
    return 0
