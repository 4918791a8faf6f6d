"""What crosses from the `specmesh ray` driver into the actors and their service processes.

Every SPECMESH_* variable (config overrides, SPECMESH_HOME), every OTEL_* variable (exporter
endpoint, service name, resource attributes, sampler) and the W3C trace context (TRACEPARENT /
TRACESTATE: taken from the environment, or injected from the driver's current OpenTelemetry
span when there is one), so spans started in the actors join the driver's trace.
"""

from __future__ import annotations

import os

PREFIXES = ("SPECMESH_", "OTEL_")
TRACE_VARS = ("TRACEPARENT", "TRACESTATE")


def trace_context_env() -> dict[str, str]:
    """The current OpenTelemetry context as TRACEPARENT/TRACESTATE ({} without a current span)."""
    try:
        from opentelemetry import propagate
    except ImportError:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return {k.upper(): v for k, v in carrier.items() if k.upper() in TRACE_VARS}


def actor_env(environ=None, extra: dict | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if k.startswith(PREFIXES) or k in TRACE_VARS}
    env.pop("SPECMESH_CONFIG", None)  # the config travels as text (see RayMeshSpec.config_text)
    env.update(trace_context_env())
    env.update(extra or {})
    return env
