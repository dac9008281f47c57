"""`tests.support.gate_proxy.GateProxy` over a real grpc.aio server and client: unarmed it forwards whole
calls; armed, the server's messages after the chosen one never reach the client, and when the server goes,
the client's connection goes with it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from tests.support.gate_proxy import GateProxy

pytestmark = pytest.mark.integration

METHOD = "/kvmesh.test.Gate/Count"
MESSAGES = [b"m%d" % i for i in range(10)]


def _ident(b: bytes) -> bytes:
    return b


class _CountServer:
    """Answers each call with `MESSAGES`; on a request of b"wait-for-gate" it holds back the messages after
    m2 until `gate` has stalled, so none of them can share a frame with m2."""

    def __init__(self) -> None:
        self.gate: GateProxy | None = None
        self.wrote_all = asyncio.Event()

    async def count(self, request: bytes, _ctx: Any) -> AsyncIterator[bytes]:
        for i, m in enumerate(MESSAGES):
            if i == 3 and request == b"wait-for-gate":
                assert self.gate is not None
                assert await asyncio.to_thread(self.gate.stalled.wait, 30)
            yield m
        self.wrote_all.set()


@pytest.fixture
async def served() -> AsyncIterator[tuple[grpc.aio.Server, _CountServer, str]]:
    impl = _CountServer()
    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(impl.count, request_deserializer=_ident, response_serializer=_ident)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kvmesh.test.Gate", {"Count": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield server, impl, f"127.0.0.1:{port}"
    await server.stop(None)


@pytest.fixture
def gate(served: tuple[grpc.aio.Server, _CountServer, str]) -> Iterator[GateProxy]:
    """A gate in front of the server that stalls after m2 (the server is told of it, for b"wait-for-gate")."""
    _, impl, address = served
    impl.gate = made = GateProxy(address, lambda m: m == b"m2")
    yield made
    made.close()


async def _call(
    channel: grpc.aio.Channel, request: bytes, got: list[bytes], three: asyncio.Event | None = None
) -> None:
    call = channel.unary_stream(METHOD, request_serializer=_ident, response_deserializer=_ident)
    async for m in call(request, timeout=30):
        got.append(m)
        if three is not None and len(got) == 3:
            three.set()


async def test_an_unarmed_or_disarmed_gate_forwards_every_message(gate: GateProxy) -> None:
    async with grpc.aio.insecure_channel(gate.address) as channel:
        first: list[bytes] = []
        await _call(channel, b"", first)
        gate.arm()
        gate.disarm()
        second: list[bytes] = []
        await _call(channel, b"", second)
    assert first == second == MESSAGES
    assert not gate.stalled.is_set()


async def test_an_armed_gate_stalls_after_the_chosen_message_and_closes_with_the_server(
    served: tuple[grpc.aio.Server, _CountServer, str], gate: GateProxy
) -> None:
    server, impl, _ = served
    async with grpc.aio.insecure_channel(gate.address) as channel:
        await channel.channel_ready()  # the connection is open before the gate watches a stream
        gate.arm()
        got: list[bytes] = []
        three = asyncio.Event()
        call = asyncio.create_task(_call(channel, b"wait-for-gate", got, three))
        # the server sent m3..m9 and its status: the gate dropped them
        await asyncio.wait_for(impl.wrote_all.wait(), 30)
        assert gate.stalled.is_set()
        # m0..m2 were forwarded: read them before the link goes (a gRPC client drops the unread ones)
        await asyncio.wait_for(three.wait(), 30)
        await server.stop(None)  # the server goes: its connection closes, and so does the client's
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await call
    assert got == MESSAGES[:3]
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
