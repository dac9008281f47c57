"""Generate frames (`kvmesh.wire.frames`) between the router's `FramedWorkerStream` and a real worker process
(simulated engine) on 127.0.0.1: the same answers as `Generate`, per-request errors that leave the connection
up, cancel → abort, a killed worker failing every pending request, a connection refused for what it sent
(garbage, another version, an oversized frame: the worker keeps serving the others), the worker's guard over
tokens and mTLS, and the router's fallback to the gRPC stream when the frames port does not answer. Generate
frames are opt-in (a service mesh cannot see them), so every worker here is started with `--frames-port 0`."""

from __future__ import annotations

import asyncio
import signal
import socket
import struct
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
import pytest_asyncio

from kvmesh.core.config import ServerSettings
from kvmesh.core.ports import free_port
from kvmesh.routing import BreakerConfig, CircuitBreaker, WorkerView
from kvmesh.security.certs import DevPki, make_dev_pki
from kvmesh.security.identity import CallerRole, Identity
from kvmesh.security.tokens import accepted_file, provision
from kvmesh.services.router.worker_frames import ConnectFailed, FramedWorkerStream
from kvmesh.services.router.worker_stream import WorkerStream
from kvmesh.services.router.workers import WorkerHandle
from kvmesh.suite.launcher import ServiceProcess, start_service
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.wire.frames import PROTOCOL_VERSION, FrameDecoder, encode_frame
from tests.support.sim_worker import gen_req, start_sim_worker

pytestmark = pytest.mark.integration
ROUTER = Identity(CallerRole.ROUTER, "router-0")
CLIENT = Identity(CallerRole.CLIENT, "alice")
WORKER = Identity(CallerRole.WORKER, "worker-0")
FRAMES_ON = ("--frames-port", "0")  # any free port (the default, -1, is off)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    sp = start_sim_worker(tmp_path_factory.mktemp("w"), "--sim-speed", "1", *FRAMES_ON)
    yield sp
    sp.terminate(timeout=30)


def frames_address(sp: ServiceProcess, credentials: grpc.ChannelCredentials | None = None) -> str:
    ch = grpc.secure_channel(sp.address, credentials) if credentials else grpc.insecure_channel(sp.address)
    with ch:
        info = worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    assert info.generate_frames_address
    return info.generate_frames_address


def refused_total(sp: ServiceProcess, reason: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{sp.http_port}/metrics", timeout=10).text
    line = f'kvmesh_worker_generate_frames_refused_total{{reason="{reason}"}} '
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(line))


async def collect(fs: FramedWorkerStream, req: worker_pb2.GenerateRequest) -> list[worker_pb2.GenerateResponse]:
    call = await fs.start(req.request_id, req.SerializeToString())
    return [m async for m in call]


@pytest_asyncio.fixture
async def frames(worker: ServiceProcess) -> AsyncIterator[FramedWorkerStream]:
    fs = FramedWorkerStream(frames_address(worker), ServerSettings())
    yield fs
    await fs.close()


async def test_concurrent_requests_share_one_connection_and_match_generate(
    worker: ServiceProcess, frames: FramedWorkerStream
) -> None:
    reqs = [gen_req(f"f{i}", list(range(10 + i, 10 + i + 40 * (i + 1))), 3 + 5 * i, detokenize=True) for i in range(4)]
    got = await asyncio.gather(*(collect(frames, r) for r in reqs))
    conn = frames._conn
    assert conn is not None and not conn.lost  # one connection, still open for the next requests
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerServiceStub(ch)
        for r, msgs in zip(reqs, got, strict=True):
            g = gen_req("g-" + r.request_id, list(r.token_ids.ids), r.sampling.max_tokens, detokenize=True)
            want = [m async for m in stub.Generate(g, timeout=30)]
            assert [list(m.token_ids) for m in msgs] == [list(m.token_ids) for m in want]
            assert "".join(m.text for m in msgs) == "".join(m.text for m in want)
            assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert msgs[-1].usage.completion_tokens == r.sampling.max_tokens
    assert frames.pending == 0


async def test_a_bad_request_fails_alone(frames: FramedWorkerStream) -> None:
    ok = await collect(frames, gen_req("before", [1, 2, 3], 2))
    conn = frames._conn
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await collect(frames, gen_req("bad", [1, 2, 3], 9000))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in (ei.value.details() or "")
    after = await collect(frames, gen_req("after", [1, 2, 3], 2))
    assert [list(m.token_ids) for m in after] == [list(m.token_ids) for m in ok]
    assert frames._conn is conn


async def test_cancel_aborts_on_the_worker(worker: ServiceProcess, frames: FramedWorkerStream) -> None:
    call = await frames.start("long", gen_req("long", list(range(1, 200)), 7000).SerializeToString())
    await anext(aiter(call))
    async with grpc.aio.insecure_channel(worker.address) as ch:
        loads = worker_pb2_grpc.WorkerServiceStub(ch).StreamLoad(
            worker_pb2.StreamLoadRequest(interval_ms=20), timeout=30
        )
        rep = (await loads.read()).report
        assert rep.running == 1
        assert call.cancel() and call.cancelled() and call.done()
        async with asyncio.timeout(10):
            while rep.running != 0:  # the worker reads cancel_request_id and aborts the engine request
                rep = (await loads.read()).report
        assert rep.kv_blocks_used == 0
        loads.cancel()
    assert (await collect(frames, gen_req("next", [5, 6, 7], 2)))[-1].usage.completion_tokens == 2


def raw_exchange(address: str, payload: bytes) -> tuple[worker_pb2.GenerateStreamResponse, bytes]:
    """Sends `payload` on a fresh connection; returns the worker's error frame and whatever followed it (the
    worker closes the connection after it, so this reads to EOF)."""
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(payload)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    first, *rest = FrameDecoder().feed(data)
    return worker_pb2.GenerateStreamResponse.FromString(first), b"".join(rest)


def hello(version: int = PROTOCOL_VERSION, authorization: str = "") -> bytes:
    return encode_frame(
        worker_pb2.GenerateFramesHello(version=version, authorization=authorization).SerializeToString()
    )


@pytest.mark.parametrize(
    ("payload", "code", "reason", "words"),
    [
        (encode_frame(b"\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT, "malformed", "hello"),
        (hello() + encode_frame(b"\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT, "malformed", "frame"),
        (hello(version=99), grpc.StatusCode.FAILED_PRECONDITION, "version", "99"),
        (hello() + struct.pack(">I", 1 << 30), grpc.StatusCode.RESOURCE_EXHAUSTED, "too_large", "1073741824"),
    ],
    ids=["garbage-hello", "garbage-request", "version", "too-large"],
)
async def test_a_connection_is_refused_for_what_it_sent_and_the_worker_serves_on(
    worker: ServiceProcess,
    frames: FramedWorkerStream,
    payload: bytes,
    code: grpc.StatusCode,
    reason: str,
    words: str,
) -> None:
    running = await frames.start("other", gen_req("other", list(range(1, 50)), 30).SerializeToString())
    before = refused_total(worker, reason)
    err, rest = await asyncio.to_thread(raw_exchange, frames.address, payload)
    assert err.request_id == "" and err.error_code == code.value[0] and words in err.error_message
    assert rest == b""  # nothing after the error: the worker closed the connection
    assert refused_total(worker, reason) == before + 1
    steps = [m async for m in running]  # another connection's request is untouched
    assert sum(len(m.token_ids) for m in steps) == 30


async def test_a_killed_worker_fails_every_pending_request(tmp_path: Path) -> None:
    sp = start_sim_worker(tmp_path, "--sim-speed", "1", *FRAMES_ON)
    fs = FramedWorkerStream(frames_address(sp), ServerSettings())
    calls = [await fs.start(f"k{i}", gen_req(f"k{i}", list(range(1, 60)), 5000).SerializeToString()) for i in range(3)]
    for c in calls:
        await anext(aiter(c))
    sp.proc.send_signal(signal.SIGKILL)
    sp.proc.wait(timeout=10)
    for c in calls:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            async with asyncio.timeout(10):
                async for _ in c:
                    pass
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert fs.pending == 0
    with pytest.raises(ConnectFailed):  # nothing listens there any more
        await fs.start("after", gen_req("after", [1, 2], 1).SerializeToString())
    await fs.close()


async def test_sigterm_finishes_in_flight_requests_and_refuses_new_ones(tmp_path: Path) -> None:
    sp = start_sim_worker(tmp_path, "--sim-speed", "1", *FRAMES_ON)
    fs = FramedWorkerStream(frames_address(sp), ServerSettings())
    call = await fs.start("inflight", gen_req("inflight", list(range(1, 60)), 40).SerializeToString())
    it = aiter(call)
    tokens = len((await anext(it)).token_ids)
    async with grpc.aio.insecure_channel(sp.address) as ch:
        loads = worker_pb2_grpc.WorkerServiceStub(ch).StreamLoad(worker_pb2.StreamLoadRequest(interval_ms=20))
        assert (await loads.read()).report.worker_id
        sp.proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(30):  # the load stream ends when the worker starts stopping
            while await loads.read() is not grpc.aio.EOF:
                pass
    late = await fs.start("late", gen_req("late", [1, 2, 3], 2).SerializeToString())
    async with asyncio.timeout(30):
        tokens += sum([len(m.token_ids) async for m in it])
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            _ = [m async for m in late]
    assert tokens == 40  # the request in flight ran to its end
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
    assert await asyncio.to_thread(sp.proc.wait, 30) == 0
    await fs.close()


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServiceProcess, dict[Identity, Path]]]:
    tokens = tmp_path_factory.mktemp("tokens")
    own = provision(tokens, [ROUTER, CLIENT, WORKER])
    flags = ("--auth-mode", "enforce", "--auth-tokens-file", str(accepted_file(tokens)))
    sp = start_sim_worker(tmp_path_factory.mktemp("wg"), "--sim-speed", "0", *flags, *FRAMES_ON)
    yield sp, own
    sp.terminate(timeout=30)


def token_settings(path: Path | None) -> ServerSettings:
    return ServerSettings(auth_token_file=str(path) if path else "")


async def test_tokens_are_checked_as_for_generate_stream(
    guarded: tuple[ServiceProcess, dict[Identity, Path]],
) -> None:
    sp, own = guarded
    with grpc.insecure_channel(sp.address) as ch:  # GetInfo is guarded too: ask it as the router
        info = worker_pb2_grpc.WorkerServiceStub(ch).GetInfo(
            worker_pb2.GetInfoRequest(), metadata=(("authorization", f"Bearer {own[ROUTER].read_text().strip()}"),)
        )
    address = info.generate_frames_address
    fs = FramedWorkerStream(address, token_settings(own[ROUTER]))
    assert (await collect(fs, gen_req("ok", [1, 2, 3], 2)))[-1].usage.completion_tokens == 2
    await fs.close()
    for path, code in [(None, grpc.StatusCode.UNAUTHENTICATED), (own[CLIENT], grpc.StatusCode.PERMISSION_DENIED)]:
        before = refused_total(sp, "denied")
        fs = FramedWorkerStream(address, token_settings(path))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await collect(fs, gen_req("no", [1, 2, 3], 2))
        assert ei.value.code() == code
        assert refused_total(sp, "denied") == before + 1
        await fs.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> DevPki:
    return make_dev_pki(tmp_path_factory.mktemp("pki"), [ROUTER, CLIENT, WORKER])


def mtls_settings(pki: DevPki, who: Identity) -> ServerSettings:
    pair = pki.pairs[who]
    return ServerSettings(tls_ca=str(pki.ca), tls_client_cert=str(pair.cert), tls_client_key=str(pair.key))


async def test_mtls_identities_are_checked_as_for_generate_stream(tmp_path: Path, pki: DevPki) -> None:
    pair, ca = pki.pairs[WORKER], str(pki.ca)
    tls = ("--tls-cert", str(pair.cert), "--tls-key", str(pair.key), "--tls-client-ca", ca)
    router_pair = pki.pairs[ROUTER]
    creds = grpc.ssl_channel_credentials(
        pki.ca.read_bytes(), router_pair.key.read_bytes(), router_pair.cert.read_bytes()
    )
    sim = ("--engine", "sim", "--sim-speed", "0", "--block-size", "16", *FRAMES_ON)
    sp = start_service("worker", tmp_path, *sim, "--auth-mode", "enforce", *tls, timeout=60, credentials=creds)
    try:
        address = frames_address(sp, creds)
        fs = FramedWorkerStream(address, mtls_settings(pki, ROUTER))
        assert (await collect(fs, gen_req("ok", [1, 2, 3], 2)))[-1].usage.completion_tokens == 2
        assert fs._conn is not None and fs._conn.transport is not None
        assert fs._conn.transport.get_extra_info("ssl_object") is not None  # the bytes went over TLS
        await fs.close()
        fs = FramedWorkerStream(address, mtls_settings(pki, CLIENT))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await collect(fs, gen_req("no", [1, 2, 3], 2))
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED and "client" in (ei.value.details() or "")
        await fs.close()
    finally:
        sp.terminate(timeout=30)


async def test_the_router_falls_back_to_the_grpc_stream_when_frames_do_not_answer(worker: ServiceProcess) -> None:
    closed = f"127.0.0.1:{free_port()}"  # nothing listens there
    async with grpc.aio.insecure_channel(worker.address) as ch:
        h = WorkerHandle(
            address=worker.address,
            channel=ch,
            stub=worker_pb2_grpc.WorkerServiceStub(ch),
            breaker=CircuitBreaker(BreakerConfig()),
            view=WorkerView(id="w", healthy=True),
            stream=WorkerStream(ch, worker.address),
            frames=FramedWorkerStream(closed, ServerSettings()),
        )
        req = gen_req("fb", [1, 2, 3], 2)
        call = await h.generate("fb", req.SerializeToString(), {})
        assert call.call is h.stream._call  # sent on the gRPC stream
        assert [m async for m in call][-1].usage.completion_tokens == 2
        assert h.frames_off_until > time.monotonic()  # frames are not tried again at once
        assert h.frames is not None and h.frames.pending == 0
        await h.stream.close()
        await h.frames.close()
