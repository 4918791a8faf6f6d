"""OpenTelemetry set-up from the standard OTEL_* environment, and trace-context helpers.

OTEL_TRACES_EXPORTER: comma list of console | otlp | none (default none: spans are still made,
so logs carry trace ids and context still propagates; nothing is exported).
OTEL_EXPORTER_OTLP_ENDPOINT / OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, OTEL_EXPORTER_OTLP_INSECURE,
OTEL_BSP_*, OTEL_TRACES_SAMPLER, OTEL_RESOURCE_ATTRIBUTES are read by the SDK itself.
OTEL_SDK_DISABLED=true: no SDK at all (the API's no-op tracer).
"""

from __future__ import annotations

import logging
import os
import threading

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

log = logging.getLogger(__name__)

TRACER_NAME = "specmesh"
_lock = threading.Lock()
_provider = None  # the SDK TracerProvider this process set, if any


def exporters_from_env(environ=None) -> list[str]:
    environ = os.environ if environ is None else environ
    raw = environ.get("OTEL_TRACES_EXPORTER", "none")
    names = [n.strip().lower() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in ("console", "otlp", "none")]
    if unknown:
        log.warning("OTEL_TRACES_EXPORTER: ignoring unknown exporter(s) %s", ", ".join(unknown))
    return [n for n in names if n in ("console", "otlp")]


def _one_line(span) -> str:
    return span.to_json(indent=None) + os.linesep


def setup_tracing(service: str, environ=None):
    """Install the SDK TracerProvider once per process (service.name = specmesh-<service>)."""
    global _provider
    environ = os.environ if environ is None else environ
    with _lock:
        if _provider is not None or environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return _provider
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

        resource = Resource.create({"service.name": f"specmesh-{service}", "service.namespace": "specmesh"})
        provider = TracerProvider(resource=resource)
        for name in exporters_from_env(environ):
            if name == "console":  # one JSON line per span, written at once (logs stay in order)
                provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(formatter=_one_line)))
            else:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

                provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        trace.set_tracer_provider(provider)
        _provider = provider
        return provider


def provider():
    """The SDK provider of this process (None when tracing is disabled)."""
    return _provider


def shutdown_tracing() -> None:
    """Flush and stop the exporters (also runs at exit)."""
    if _provider is not None:
        _provider.shutdown()


def tracer():
    return trace.get_tracer(TRACER_NAME)


def extract(metadata):
    """The parent trace context carried in gRPC invocation metadata."""
    return propagate.extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})


def inject() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata (traceparent, tracestate, baggage)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def start_server_span(name: str, parent_ctx, attributes: dict):
    return tracer().start_span(name, context=parent_ctx, kind=SpanKind.SERVER, attributes=attributes)


def trace_ids() -> tuple[str | None, str | None]:
    """(trace_id, span_id) of the current span as hex, or (None, None)."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None, None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def set_attributes(attributes: dict) -> None:
    """Set attributes on the current span (None values skipped)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
