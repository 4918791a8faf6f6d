"""What `specmesh ray` hands to its actors (no Ray needed): env selection, trace context, specs."""

from __future__ import annotations

from dataclasses import asdict

from specmesh.ray.env import actor_env
from specmesh.ray.spec import RayMeshSpec, TierSpec


def test_actor_env_keeps_specmesh_otel_and_trace_context_only():
    env = actor_env(environ={"SPECMESH_RUNTIME__LOG_LEVEL": "DEBUG", "SPECMESH_CONFIG": "/x.yaml",
                             "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "TRACEPARENT": "00-a-b-01",
                             "HOME": "/root", "PATH": "/bin"})
    assert env == {"SPECMESH_RUNTIME__LOG_LEVEL": "DEBUG", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                   "TRACEPARENT": "00-a-b-01"}  # the config travels as text, not as a path


def test_current_span_becomes_traceparent():
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    tracer = TracerProvider().get_tracer("t")
    with tracer.start_as_current_span("driver") as span:
        env = actor_env(environ={})
    ctx = span.get_span_context()
    assert env["TRACEPARENT"].startswith(f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-")
    assert trace.get_current_span() is not span


def test_spec_round_trips_through_a_plain_dict():
    spec = RayMeshSpec("redis://r:1/0", tiers={"target": TierSpec(2, 1, 1.0, {"target_gpu": 1}),
                                               "draft": TierSpec(3), "coordinator": TierSpec(), "gateway": TierSpec()})
    data = asdict(spec)  # what the controller actor receives
    assert data["tiers"]["target"] == {"replicas": 2, "num_cpus": 1, "num_gpus": 1.0, "resources": {"target_gpu": 1}}
    assert RayMeshSpec(**{**data, "tiers": data["tiers"]}).tier("draft").replicas == 3
