"""OpenTelemetry across a real in-process mesh: one trace over gateway, coordinator, draft worker
and target worker (context carried in gRPC metadata), GenAI + specmesh.* attributes, the key
name (never the key), no spans for health checks or the gateway's probe."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from prod_helpers import bearer, start_mesh, wait_until
from specmesh.auth.guard import Guard
from specmesh.auth.keys import KeyRecord, hash_key
from specmesh.telemetry import tracing
from specmesh.v1 import specmesh_pb2 as pb

pytestmark = pytest.mark.service
KEY = "smk_telemetry-test-key"
ROLES = {"gateway", "coordinator", "draft_worker", "target_worker"}


class OneKeyStore:
    def get(self, key_hash):
        return KeyRecord("tele-key", key_hash) if key_hash == hash_key(KEY) else None


@pytest.fixture(scope="module")
def traced(target_model, prompt_encoder):
    guard = Guard(OneKeyStore(), None, required=True, ratelimit_enabled=False)
    mesh = start_mesh(target_model, prompt_encoder, guard=guard)
    provider = tracing.provider()
    if provider is None:
        mesh.stop()
        pytest.skip("OTEL_SDK_DISABLED")
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield mesh, exporter
    exporter.shutdown()  # the processor stays on the provider but drops everything from now on
    mesh.stop()


def spans_of(exporter, trace_id: int):
    return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]


def by_role(spans, role):
    return [s for s in spans if s.attributes.get("specmesh.service") == role]


def gateway_span(exporter, request_id):
    found = [s for s in exporter.get_finished_spans()
             if s.attributes.get("specmesh.service") == "gateway" and s.attributes.get("specmesh.request_id") == request_id]
    return found[0] if found else None


def test_one_trace_across_all_four_services(traced):
    mesh, exporter = traced
    resp = mesh.gateway_stub.Generate(pb.GenerateRequest(prompt="Say hello hello hello.", max_tokens=4,
                                                         request_id="tele-1"), timeout=120, metadata=bearer(KEY))
    assert wait_until(lambda: gateway_span(exporter, "tele-1") is not None, 30)
    gw = gateway_span(exporter, "tele-1")
    spans = spans_of(exporter, gw.context.trace_id)
    assert {s.attributes.get("specmesh.service") for s in spans} >= ROLES
    (coord,) = by_role(spans, "coordinator")
    assert coord.parent.span_id == gw.context.span_id  # gateway -> coordinator
    for s in by_role(spans, "target_worker") + by_role(spans, "draft_worker"):
        assert s.parent.span_id == coord.context.span_id  # coordinator -> workers
        assert s.kind == trace.SpanKind.SERVER
    assert {s.name for s in by_role(spans, "target_worker")} >= {"specmesh.v1.TargetWorker/Prefill",
                                                                 "specmesh.v1.TargetWorker/Verify"}
    for s in (gw, coord):
        a = s.attributes
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "smollm2-135m-instruct"
        assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.temperature"] == 0.0
        assert a["gen_ai.usage.output_tokens"] == resp.usage.completion_tokens
        assert a["gen_ai.usage.input_tokens"] == resp.usage.prompt_tokens
        assert tuple(a["gen_ai.response.finish_reasons"]) == (resp.finish_reason,)
        assert a["specmesh.rounds"] == resp.spec.rounds and a["specmesh.drafter"] == resp.spec.method
        assert "specmesh.acceptance_length" in a and "specmesh.accepted_tokens" in a
    assert coord.attributes["specmesh.speculation.enabled"] is True
    assert gw.attributes["specmesh.api_key.name"] == "tele-key"
    assert coord.attributes["specmesh.api_key.name"] == "tele-key"  # the name travels with the request
    assert not any(KEY in str(s.attributes) for s in spans)


@pytest.mark.parametrize("share, arm", [(1.0, "spec"), (0.0, "control")])
def test_every_span_of_a_request_carries_its_canary_arm(traced, share, arm):
    mesh, exporter = traced
    rid = f"tele-arm-{arm}"
    mesh.coordinator.control.set(share=share)
    try:
        resp = mesh.gateway_stub.Generate(pb.GenerateRequest(prompt="Say hello hello hello.", max_tokens=4,
                                                             request_id=rid), timeout=120, metadata=bearer(KEY))
    finally:
        mesh.coordinator.control.set(reset=True)
    assert resp.spec.arm == arm and (resp.spec.method == "off") == (arm == "control")
    assert wait_until(lambda: gateway_span(exporter, rid) is not None, 30)
    spans = spans_of(exporter, gateway_span(exporter, rid).context.trace_id)
    # (the draft worker only when a round drafted: goodput may pause an unpromising drafter)
    assert {s.attributes.get("specmesh.service") for s in spans} >= {"gateway", "coordinator", "target_worker"}
    assert {s.name: s.attributes.get("specmesh.canary.arm") for s in spans} == {s.name: arm for s in spans}


def test_a_client_trace_context_is_continued(traced):
    mesh, exporter = traced
    parent = tracing.provider().get_tracer("client").start_span("client-call")
    carrier = {}
    from opentelemetry import propagate

    propagate.inject(carrier, context=trace.set_span_in_context(parent))
    mesh.gateway_stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=2, request_id="tele-2"), timeout=120,
                               metadata=bearer(KEY) + list(carrier.items()))
    parent.end()
    assert wait_until(lambda: gateway_span(exporter, "tele-2") is not None, 30)
    gw = gateway_span(exporter, "tele-2")
    assert gw.context.trace_id == parent.get_span_context().trace_id
    assert gw.parent.span_id == parent.get_span_context().span_id


def test_errors_are_recorded_on_the_span(traced):
    mesh, exporter = traced
    with pytest.raises(grpc.RpcError) as exc:
        mesh.gateway_stub.Generate(pb.GenerateRequest(prompt="hi", max_tokens=0, request_id="tele-3"), timeout=60,
                                   metadata=bearer(KEY))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wait_until(lambda: any(s.attributes.get("rpc.grpc.status_code") == 3 for s in exporter.get_finished_spans()))
    bad = [s for s in exporter.get_finished_spans() if s.attributes.get("rpc.grpc.status_code") == 3][-1]
    assert bad.status.status_code == trace.StatusCode.ERROR


def test_health_checks_and_the_probe_are_not_traced(traced):
    from gateway.health import MeshProbe

    mesh, exporter = traced
    exporter.clear()
    for svc in mesh.services.values():
        with grpc.insecure_channel(svc.listen) as ch:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    probe = MeshProbe(mesh.gateway.coordinator, lambda ok: None, mesh.cfg.health)
    assert probe.check_once()
    assert exporter.get_finished_spans() == ()
