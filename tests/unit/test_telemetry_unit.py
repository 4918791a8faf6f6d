"""Telemetry pieces without servers: GenAI attribute names, exporter selection, request context
and what the client interceptor puts into outgoing metadata."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from specmesh.core.types import GenerationRequest, SamplingParams
from specmesh.telemetry import context as reqctx
from specmesh.telemetry import genai
from specmesh.telemetry.interceptors import ClientInterceptor, _Details
from specmesh.telemetry.tracing import exporters_from_env


def test_request_attributes_follow_genai_semconv():
    req = GenerationRequest([1, 2, 3], 64, SamplingParams(temperature=0.7, top_p=0.9, seed=3), "ngram", 4,
                            request_id="r1")
    a = genai.request_attributes("smollm2", req)
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == "smollm2"
    assert a["gen_ai.request.max_tokens"] == 64
    assert abs(a["gen_ai.request.temperature"] - 0.7) < 1e-6
    assert a["specmesh.request_id"] == "r1"
    assert genai.request_attributes("m", req, raw=True)["gen_ai.operation.name"] == "text_completion"


def test_response_and_spec_attributes():
    r = genai.response_attributes(10, 5, "length", "r1")
    assert r["gen_ai.usage.input_tokens"] == 10 and r["gen_ai.usage.output_tokens"] == 5
    assert r["gen_ai.response.finish_reasons"] == ["length"]
    s = genai.spec_attributes("ngram", 3, 12, 7, 2.5, 0, True, 4)
    assert s["specmesh.rounds"] == 3 and s["specmesh.drafted_tokens"] == 12
    assert s["specmesh.accepted_tokens"] == 7 and s["specmesh.acceptance_length"] == 2.5
    assert s["specmesh.drafter"] == "ngram" and s["specmesh.speculation.enabled"] is True
    assert s["specmesh.canary.arm"] is None  # skipped on spans
    assert genai.spec_attributes("off", 3, 0, 0, 1.0, arm="control")["specmesh.canary.arm"] == "control"


def test_exporters_from_env():
    assert exporters_from_env({}) == []
    assert exporters_from_env({"OTEL_TRACES_EXPORTER": "none"}) == []
    assert exporters_from_env({"OTEL_TRACES_EXPORTER": "console"}) == ["console"]
    assert exporters_from_env({"OTEL_TRACES_EXPORTER": "console, OTLP,bogus"}) == ["console", "otlp"]


def test_request_context_round_trips_through_metadata():
    info = reqctx.RequestInfo("gateway", "Generate", request_id="r9", key_name="alice")
    md = reqctx.outgoing_metadata(info)
    back = reqctx.from_metadata("coordinator", "Generate", md)
    assert (back.request_id, back.key_name, back.probe, back.arm) == ("r9", "alice", False, "")
    armed = reqctx.RequestInfo("coordinator", "Generate", request_id="r9", arm="control")
    assert reqctx.from_metadata("target_worker", "Verify", reqctx.outgoing_metadata(armed)).arm == "control"
    assert reqctx.from_metadata("x", "y", reqctx.outgoing_metadata(
        reqctx.RequestInfo("g", "p", probe=True))).probe
    assert reqctx.outgoing_metadata(None) == []
    assert not any(k == "authorization" for k, _ in md)  # never the key


def _sent(info=None, span=None):
    captured = {}

    def continuation(details, request):
        captured["md"] = dict(details.metadata)
        return "resp"

    d = _Details("/svc/M", 1.0, [("x-own", "1")], None, None, None)
    with reqctx.active(info):
        if span is not None:
            with trace.use_span(span, end_on_exit=True):
                assert ClientInterceptor().intercept_unary_unary(continuation, d, object()) == "resp"
        else:
            ClientInterceptor().intercept_unary_unary(continuation, d, object())
    return captured["md"]


def test_client_interceptor_forwards_trace_context_and_request_facts():
    span = TracerProvider().get_tracer("t").start_span("parent")
    md = _sent(reqctx.RequestInfo("gateway", "Generate", request_id="r1", key_name="alice"), span)
    trace_id = f"{span.get_span_context().trace_id:032x}"
    assert md["traceparent"].split("-")[1] == trace_id
    assert md[reqctx.REQUEST_ID_KEY] == "r1" and md[reqctx.KEY_NAME_KEY] == "alice"
    assert md["x-own"] == "1"


def test_client_interceptor_sends_no_trace_context_for_the_health_probe():
    span = TracerProvider().get_tracer("t").start_span("parent")
    md = _sent(reqctx.RequestInfo("gateway", "HealthProbe", probe=True), span)
    assert "traceparent" not in md and md[reqctx.PROBE_KEY] == "1"
