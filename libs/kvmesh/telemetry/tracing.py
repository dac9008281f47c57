"""OpenTelemetry tracing set-up: a tracer provider per service, OTLP export only when an endpoint is configured.

Context travels in W3C `traceparent` metadata, extracted by the per-call instrumentation
(`kvmesh.rpc.interceptors`) and injected by outbound calls (`kvmesh.rpc.channel`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, MutableMapping

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

_configured = False
_recording = True  # False once `setup_tracing` installed the ALWAYS_OFF provider: no span is worth creating


def recording() -> bool:
    """Whether spans are recorded. When not, hot paths skip creating them altogether (a non-recording span
    still costs ids, a sampler call and a context switch per request) and only pass trace context along."""
    return _recording


def setup_tracing(service: str, otlp_endpoint: str | None = None, exporter: SpanExporter | None = None) -> None:
    """Installs the global tracer provider once. `exporter` (tests) wins over `otlp_endpoint`. With neither,
    spans are not recorded (sampler ALWAYS_OFF: nothing could read them; trace context still propagates),
    which keeps span attributes, events and ids off every request's hot path."""
    global _configured, _recording
    if _configured:
        return
    resource = Resource.create({"service.name": f"kvmesh-{service}"})
    if exporter is None and not otlp_endpoint:
        trace.set_tracer_provider(TracerProvider(resource=resource, sampler=ALWAYS_OFF))
        _configured = True
        _recording = False
        return
    provider = TracerProvider(resource=resource)
    if exporter is None and otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=otlp_endpoint, insecure=not otlp_endpoint.startswith("https"))
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _configured = True


@functools.lru_cache(maxsize=64)
def tracer(name: str) -> trace.Tracer:
    """A tracer for a module (cached: `get_tracer` costs tens of µs and is asked for on every RPC)."""
    return trace.get_tracer(name)


def extract(carrier: Mapping[str, str]):  # type: ignore[no-untyped-def]
    """The trace context of incoming metadata."""
    return propagate.extract(carrier)


def inject(carrier: MutableMapping[str, str]) -> None:
    """Adds the current trace context to outgoing metadata."""
    propagate.inject(carrier)
