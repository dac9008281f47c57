"""The floor of a Python gRPC hop: what any grpc.aio router costs before it does any work.

    python -m kvmesh.bench grpc-hop [--payload-bytes 32768] [--calls 1500] [--uvloop]

Three processes on loopback: an echo server (a unary-stream method that answers one 20-byte message), a bare
proxy (the same method, forwarding the request bytes to the echo server and its messages back: no parsing, no
routing, no instrumentation) and the client in this process, which times sequential calls straight to the
echo server (`direct`) and through the proxy (`proxy`), alternating twice. Prints one JSON line with the p50s
and `hop_ms` = proxy − direct (the median of the two rounds).

Then `--concurrent-calls` calls at `--concurrency` go through the proxy, and the CPU time (user + system, /proc)
of each server process over them gives `echo_cpu_us_per_call` (a grpc.aio server answering a unary-stream
call with one message: the floor of any grpc.aio front end) and `proxy_cpu_us_per_call` (a bare proxy: that
server plus a grpc.aio client call, no kvmesh code), with `concurrent_calls_per_s`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import grpc

from kvmesh.bench.process_cpu import tree_cpu_s

METHOD = "/kvmesh.bench.Hop/Call"
OPTS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def _ident(b: bytes) -> bytes:
    return b


async def _serve(handler: Any, port_file: Path, max_receive_bytes: int = 64 << 20) -> None:
    opts = [("grpc.max_receive_message_length", max_receive_bytes), ("grpc.max_send_message_length", 64 << 20)]
    server = grpc.aio.server(options=opts)
    h = grpc.method_handlers_generic_handler(
        "kvmesh.bench.Hop",
        {
            "Call": grpc.unary_stream_rpc_method_handler(
                handler, request_deserializer=_ident, response_serializer=_ident
            )
        },
    )
    server.add_generic_rpc_handlers((h,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    port_file.write_text(str(port))
    await server.wait_for_termination()


async def _echo(req: bytes, ctx: Any) -> AsyncIterator[bytes]:
    yield b"x" * 20


async def _proxy(upstream_port: int, port_file: Path) -> None:
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{upstream_port}", options=OPTS)
    up = ch.unary_stream(METHOD, request_serializer=_ident, response_deserializer=_ident)

    async def forward(req: bytes, ctx: Any) -> AsyncIterator[bytes]:
        async for m in up(req):
            yield m

    await _serve(forward, port_file)


async def _concurrent_calls(port: int, payload: bytes, calls: int, concurrency: int) -> float:
    """Sends `calls` calls with `concurrency` in flight over 4 channels; returns the wall seconds."""
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTS) for _ in range(4)]
    stubs = [ch.unary_stream(METHOD, request_serializer=_ident, response_deserializer=_ident) for ch in chans]
    todo = iter(range(calls))

    async def loop() -> None:
        for i in todo:
            async for _ in stubs[i % len(stubs)](payload, timeout=10):
                pass

    t = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(concurrency)))
    wall = time.perf_counter() - t
    for ch in chans:
        await ch.close()
    return wall


async def _time_calls(port: int, payload: bytes, calls: int) -> float:
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTS)
    call = ch.unary_stream(METHOD, request_serializer=_ident, response_deserializer=_ident)
    lat = []
    for _ in range(calls):
        t = time.perf_counter()
        async for _ in call(payload, timeout=10):
            pass
        lat.append(time.perf_counter() - t)
    await ch.close()
    return statistics.median(lat) * 1e3


def start_echo_server(
    port_file: Path, max_receive_bytes: int = 64 << 20, uvloop: bool = False
) -> tuple[subprocess.Popen[bytes], int]:
    """A bare grpc.aio echo server (`METHOD`, no kvmesh code) in its own process; returns it and its port."""
    me = [sys.executable, "-m", "kvmesh.bench", "grpc-hop", *(["--uvloop"] if uvloop else [])]
    cmd = [*me, "--role", "echo", "--port-file", str(port_file), "--max-receive-bytes", str(max_receive_bytes)]
    proc = subprocess.Popen(cmd)
    try:
        return proc, _wait_port(port_file, proc)
    except BaseException:
        proc.kill()
        proc.wait(timeout=10)
        raise


def _wait_port(f: Path, proc: subprocess.Popen[bytes]) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if f.exists() and f.read_text():
            return int(f.read_text())
        if proc.poll() is not None:
            raise SystemExit(f"hop helper exited with {proc.returncode}")
        time.sleep(0.02)
    raise SystemExit("hop helper did not start in 30 s")


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvmesh.bench grpc-hop")
    ap.add_argument("--payload-bytes", type=int, default=32768)
    ap.add_argument("--calls", type=int, default=1500)
    ap.add_argument("--concurrent-calls", type=int, default=4000, help="calls of the concurrency phase")
    ap.add_argument("--concurrency", type=int, default=32, help="calls in flight in the concurrency phase")
    ap.add_argument("--uvloop", action="store_true", help="run all three processes on uvloop")
    ap.add_argument("--role", choices=("client", "echo", "proxy"), default="client", help=argparse.SUPPRESS)
    ap.add_argument("--port-file", default="", help=argparse.SUPPRESS)
    ap.add_argument("--upstream", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--max-receive-bytes", type=int, default=64 << 20, help=argparse.SUPPRESS)
    a = ap.parse_args(list(argv))
    if a.concurrent_calls < 1 or a.concurrency < 1:
        ap.error("--concurrent-calls and --concurrency must be at least 1")
    if a.uvloop:
        import uvloop

        uvloop.install()
    if a.role == "echo":
        asyncio.run(_serve(_echo, Path(a.port_file), a.max_receive_bytes))
        return 0
    if a.role == "proxy":
        asyncio.run(_proxy(a.upstream, Path(a.port_file)))
        return 0
    me = [sys.executable, "-m", "kvmesh.bench", "grpc-hop", *(["--uvloop"] if a.uvloop else [])]
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-hop-") as tmp:
        try:
            f1, f2 = Path(tmp) / "echo", Path(tmp) / "proxy"
            echo, echo_port = start_echo_server(f1, uvloop=a.uvloop)
            procs.append(echo)
            proxy_cmd = [*me, "--role", "proxy", "--port-file", str(f2), "--upstream", str(echo_port)]
            procs.append(subprocess.Popen(proxy_cmd))
            proxy_port = _wait_port(f2, procs[-1])
            payload = os.urandom(a.payload_bytes)

            async def rounds() -> dict[str, list[float]]:
                out: dict[str, list[float]] = {"direct": [], "proxy": []}
                for _ in range(2):
                    out["direct"].append(await _time_calls(echo_port, payload, a.calls))
                    out["proxy"].append(await _time_calls(proxy_port, payload, a.calls))
                return out

            r = asyncio.run(rounds())
            cpu0 = [tree_cpu_s(p.pid) for p in procs]
            wall = asyncio.run(_concurrent_calls(proxy_port, payload, a.concurrent_calls, a.concurrency))
            echo_cpu, proxy_cpu = (tree_cpu_s(p.pid) - c for p, c in zip(procs, cpu0, strict=True))
        finally:
            for p in procs:
                p.kill()
                p.wait(timeout=10)
    res = {
        "bench": "grpc-hop",
        "payload_bytes": a.payload_bytes,
        "calls": a.calls,
        "uvloop": a.uvloop,
        "direct_p50_ms": [round(x, 3) for x in r["direct"]],
        "proxy_p50_ms": [round(x, 3) for x in r["proxy"]],
        "hop_ms": round(statistics.median(p - d for p, d in zip(r["proxy"], r["direct"], strict=True)), 3),
        "concurrency": a.concurrency,
        "concurrent_calls": a.concurrent_calls,
        "concurrent_calls_per_s": round(a.concurrent_calls / wall, 1),
        "echo_cpu_us_per_call": round(echo_cpu / a.concurrent_calls * 1e6, 1),
        "proxy_cpu_us_per_call": round(proxy_cpu / a.concurrent_calls * 1e6, 1),
    }
    print(json.dumps(res, sort_keys=True))
    return 0
