"""`python -m kvmesh.bench kvsync --quick` prints the benchmark contract's JSON line, every row present."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from kvmesh.bench.delay_proxy import NATIVE
from kvmesh.bench.kvsync import tiny_block_bytes, tiny_spec

pytestmark = pytest.mark.integration

# Both relay engines are held to the same behaviour; the native one only where its extension was built.
ENGINES = [
    pytest.param("native", marks=pytest.mark.skipif(not NATIVE, reason="kvmesh.bench._link is not built")),
    "python",
]


def test_tiny_block_bytes_follows_the_tiny_model_spec() -> None:
    spec = tiny_spec()
    assert spec["num_hidden_layers"] == 2 and spec["num_key_value_heads"] == 2
    assert tiny_block_bytes() == 2 * 2 * 2 * 32 * 32 * 2 == 16384
    assert tiny_block_bytes({**spec, "num_hidden_layers": 4}) == 2 * 16384


def test_kvsync_bench_quick_prints_one_json_line_per_the_contract() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.bench", "kvsync", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stdout
    res = json.loads(lines[0])
    tiny = res["tiny_block_bytes"]
    assert tiny == 16384
    keys = {(r["transport"], r["blocks"], r["block_bytes"]) for r in res["results"]}
    transports = ("shm", "mooncake", "mooncake_arena", "grpc", "link")
    if res["link_mode"].startswith("netns"):  # TE through the link's proxies needs the zone's own port space
        transports += ("mooncake_link",)
    assert res["transports"] == ["shm", "mooncake", "grpc"]  # all by default
    assert keys == {(t, n, b) for t in transports for n in (1, 8, 32, 128) for b in (tiny, 1 << 20)}
    for r in res["results"]:
        assert {"p50_ms", "p99_ms", "gbps"} <= r.keys()
        assert 0 < r["p50_ms"] <= r["p99_ms"] and r["gbps"] > 0
    for ref in ("memcpy", "socket"):
        assert {r["block_bytes"] for r in res[ref]} == {tiny, 1 << 20}
        assert all(r["gbps"] > 0 for r in res[ref])
    assert 0 <= res["integrity_share"] < 1
    assert set(res["integrity_share_by_transport"]) == set(transports)
    for path in ("shm_check_128_blocks", "grpc_check_128_blocks"):
        assert {r["block_bytes"] for r in res[path]} == {tiny, 1 << 20}
        for r in res[path]:
            assert r["copy_ms"] > 0 and r["checked_copy_ms"] > 0 and r["extra_ms"] >= 0
    assert res["link_mode"].startswith(("netns+proxy", "loopback+proxy"))
    # the link adds a 1 ms round trip: no pull over it (at least one call) can take less
    assert min(r["p50_ms"] for r in res["results"] if r["transport"] == "link") > 1.0
    assert res["link_added_rtt_ms"] == 1.0
    for preleased in ("shm_preleased", "mooncake_preleased"):
        assert {(r["blocks"], r["block_bytes"]) for r in res[preleased]} == {
            (n, b) for n in (1, 8, 32, 128) for b in (tiny, 1 << 20)
        }
    assert set(res["must_show"]) >= {
        "shm_32_tiny_p99_ms",
        "grpc_32_tiny_p99_ms",
        "shm_128x1mib_over_memcpy",
        "mooncake_32_tiny_p99_ms",
        "mooncake_128x1mib_gbps",
    }
    floor = res["mooncake_floor_32_tiny"]  # the pull's parts timed alone: what a leased pull cannot beat
    assert {"unary_rpc", "acquire_lease", "te_read", "pull_preleased", "pull"} <= floor.keys()
    assert floor["floor_p50_ms"] == round(floor["unary_rpc"]["p50_ms"] + floor["te_read"]["p50_ms"], 4)
    assert res["must_show"]["mooncake_32_tiny_floor_p50_ms"] == floor["floor_p50_ms"]


@pytest.mark.parametrize("engine", ENGINES)
def test_delay_proxy_adds_its_delay_each_way_and_forwards_bytes_intact(engine: str) -> None:
    server = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=echo, daemon=True).start()
    target = f"127.0.0.1:{server.getsockname()[1]}"
    proxy = subprocess.Popen(
        [sys.executable, "-m", "kvmesh.bench.delay_proxy", "--target", target, "--delay-ms", "20", "--engine", engine],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proxy.stdout is not None
        port = int(proxy.stdout.readline())
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            payload = os.urandom(100_000)
            start = time.monotonic()
            sock.sendall(payload)
            got = bytearray()
            while len(got) < len(payload):  # bounded: each recv returns > 0 bytes or the test fails
                chunk = sock.recv(65536)
                assert chunk, "proxy closed early"
                got += chunk
            elapsed = time.monotonic() - start
        assert bytes(got) == payload
        assert elapsed >= 0.040  # 20 ms each way
    finally:
        proxy.kill()
        proxy.wait(timeout=30)
        server.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_delay_proxy_caps_the_rate_reports_progress_and_drops_in_flight_bytes_on_close(engine: str) -> None:
    """1 MB sent through `--rate 2e6 --report-every 100000 --drop-on-close`, then the target closes at once
    (its kernel flushes the bytes to the proxy): the client gets the bytes paced, sees `forwarded` reports
    match what it received, and loses the tail the proxy still held when the target's FIN arrived."""
    server = socket.create_server(("127.0.0.1", 0))
    payload = os.urandom(1_000_000)

    def blast() -> None:
        conn, _ = server.accept()
        with conn:
            conn.recv(1)
            conn.sendall(payload)

    threading.Thread(target=blast, daemon=True).start()
    cmd = [sys.executable, "-m", "kvmesh.bench.delay_proxy", "--target", f"127.0.0.1:{server.getsockname()[1]}"]
    cmd += ["--rate", "2000000", "--report-every", "100000", "--drop-on-close", "--engine", engine]
    proxy = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proxy.stdout is not None
        port = int(proxy.stdout.readline())
        got = bytearray()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            start = time.monotonic()
            sock.sendall(b"x")
            while chunk := sock.recv(65536):  # bounded: the proxy closes once the target did
                got += chunk
            elapsed = time.monotonic() - start
        proxy.kill()
        reports = [int(line.split()[1]) for line in proxy.stdout.read().splitlines()]
    finally:
        proxy.kill()
        proxy.wait(timeout=30)
        server.close()
    assert 0 < len(got) < len(payload) and bytes(got) == payload[: len(got)]  # a prefix: the tail was dropped
    assert elapsed >= 0.8 * len(got) / 2_000_000  # paced at the cap (the first piece goes at once)
    assert reports and reports == sorted(reports) and reports[-1] <= len(got)


def test_delay_proxy_refuses_an_unknown_engine() -> None:
    cmd = [sys.executable, "-m", "kvmesh.bench.delay_proxy", "--target", "127.0.0.1:1", "--engine", "bogus"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--engine" in out.stderr and not out.stdout


def _echo_server(server: socket.socket, connections: int) -> None:
    """Echoes each of `connections` accepted connections in a thread of its own, until its client closes."""

    def echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    for _ in range(connections):
        conn, _ = server.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()


def _echo_through(port: int, payload: bytes) -> bytes:
    """Sends `payload` from a thread while reading the echo (sending all first could fill every buffer on the
    way and the echo's); returns what came back before the proxy closed or `len(payload)` bytes arrived."""
    got = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,), daemon=True)
        sender.start()
        while len(got) < len(payload):  # bounded: each recv returns > 0 bytes, or times out and fails
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
        sender.join(timeout=20)
    return bytes(got)


@pytest.mark.skipif(not NATIVE, reason="kvmesh.bench._link is not built")
@pytest.mark.parametrize("rate", ["0", "20000000"])
def test_native_delay_proxy_relays_many_concurrent_connections_intact(rate: str) -> None:
    """20 connections at once, each echoing its own random 300 kB through one native proxy (1 ms each way;
    uncapped, and capped at 20 MB/s per direction): every one gets its own bytes back, whole and in order."""
    connections = 20
    server = socket.create_server(("127.0.0.1", 0), backlog=connections)
    threading.Thread(target=_echo_server, args=(server, connections), daemon=True).start()
    cmd = [sys.executable, "-m", "kvmesh.bench.delay_proxy", "--target", f"127.0.0.1:{server.getsockname()[1]}"]
    cmd += ["--delay-ms", "1", "--rate", rate, "--engine", "native"]
    proxy = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    payloads = [os.urandom(300_000) for _ in range(connections)]
    results: dict[int, bytes] = {}
    try:
        assert proxy.stdout is not None
        port = int(proxy.stdout.readline())

        def client(i: int) -> None:
            results[i] = _echo_through(port, payloads[i])

        clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(connections)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(timeout=60)
        assert proxy.poll() is None, "the proxy died"
    finally:
        proxy.kill()
        proxy.wait(timeout=30)
        server.close()
    assert sorted(results) == list(range(connections))
    for i, payload in enumerate(payloads):
        assert results[i] == payload, f"connection {i}: {len(results[i])} of {len(payload)} bytes, or not its own"


@pytest.mark.skipif(os.environ.get("KVMESH_REQUIRE_NATIVE") != "1", reason="native build not required here")
def test_native_link_engine_is_built_where_required() -> None:
    """Where CI builds the C extensions, the native relay is what the link tests and benches run."""
    assert NATIVE, "kvmesh.bench._link failed to build"
