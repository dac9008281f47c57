"""Per-call tracing in `kvmesh.rpc.interceptors`: a recorded server span under the caller's trace, or, with
tracing off, no span at all but the caller's trace context passed on to the calls a handler makes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.rpc.interceptors import InstrumentedServer
from kvmesh.telemetry import tracing

pytestmark = pytest.mark.unit

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


async def _outbound_traceparent(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    """What a call made by this handler would carry (as the router injects it into its worker call)."""
    carrier: dict[str, str] = {}
    tracing.inject(carrier)
    return carrier.get("traceparent", "").encode()


async def _call(traceparent: str | None) -> str:
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler(
        "t.Echo", {"Trace": grpc.unary_unary_rpc_method_handler(_outbound_traceparent)}
    )
    InstrumentedServer(server, "test").add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            meta = (("traceparent", traceparent),) if traceparent else ()
            out: bytes = await ch.unary_unary("/t.Echo/Trace")(b"", metadata=meta, timeout=10)
            return out.decode()
    finally:
        await server.stop(None)


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "_recording", True)
    monkeypatch.setattr(tracing, "tracer", lambda name: provider.get_tracer(name))
    yield exporter


async def test_recorded_span_continues_the_callers_trace(spans: InMemorySpanExporter) -> None:
    outbound = await _call(TRACEPARENT)
    (span,) = spans.get_finished_spans()
    assert span.name == "test/Trace"
    assert span.parent is not None and format(span.parent.span_id, "016x") == PARENT_ID
    assert format(span.context.trace_id, "032x") == TRACE_ID
    # calls made by the handler are children of the server span
    assert outbound == f"00-{TRACE_ID}-{format(span.context.span_id, '016x')}-01"


async def test_tracing_off_creates_no_span_but_passes_the_trace_on(
    spans: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracing, "_recording", False)
    assert await _call(TRACEPARENT) == TRACEPARENT
    assert await _call(None) == ""
    assert spans.get_finished_spans() == ()


async def _stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield await _outbound_traceparent(request, context)
    yield await _outbound_traceparent(request, context)


async def test_stream_handler_keeps_the_context_across_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "_recording", False)
    server = grpc.aio.server()
    handler = grpc.method_handlers_generic_handler("t.Echo", {"S": grpc.unary_stream_rpc_method_handler(_stream)})
    InstrumentedServer(server, "test").add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            call = ch.unary_stream("/t.Echo/S")(b"", metadata=(("traceparent", TRACEPARENT),), timeout=10)
            got = [m.decode() async for m in call]
    finally:
        await server.stop(None)
    assert got == [TRACEPARENT, TRACEPARENT]
