"""Prometheus metrics of a real in-process mesh, scraped over HTTP from /metrics."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prod_helpers import start_mesh, wait_until
from specmesh.telemetry.workers import watch_target_engine
from specmesh.v1 import specmesh_pb2 as pb

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def scraped(target_model, prompt_encoder):
    from specmesh.rpc.server import Service

    mesh = start_mesh(target_model, prompt_encoder)
    watch_target_engine(mesh.engine)
    # a service with its own /metrics on a free port (metrics.<service>_port: -1)
    svc = Service("specmesh.v1.DraftWorker", "127.0.0.1:0", lambda s: None, 4, metrics_port=-1).start()
    assert svc.metrics_port and svc.metrics_port > 0

    def scrape() -> dict:
        body = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10).read().decode()
        out = {}
        for fam in text_string_to_metric_families(body):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    yield mesh, scrape
    svc.stop(0.5)
    mesh.stop()


def get(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_speculation_latency_and_rpc_metrics_move(scraped):
    mesh, scrape = scraped
    before = scrape()
    resp = mesh.gateway_stub.Generate(pb.GenerateRequest(prompt="Repeat: red blue red blue red blue red blue",
                                                         max_tokens=6), timeout=120)
    with pytest.raises(grpc.RpcError):
        mesh.gateway_stub.Generate(pb.GenerateRequest(prompt="x", max_tokens=0), timeout=30)
    after = scrape()

    def delta(name, **labels):
        return get(after, name, **labels) - get(before, name, **labels)

    assert delta("specmesh_rpc_requests_total", service="gateway", method="Generate", code="OK") == 1
    assert delta("specmesh_rpc_requests_total", service="gateway", method="Generate", code="INVALID_ARGUMENT") == 1
    # one Verify call per chosen k; a call is one target step or a burst of several (spec.rounds: steps)
    calls = sum(resp.spec.chosen_k.values())
    assert 1 <= calls <= resp.spec.rounds
    assert delta("specmesh_rpc_requests_total", service="target_worker", method="Verify", code="OK") == calls
    assert delta("specmesh_acceptance_length_count", method=resp.spec.method, arm="spec") == resp.spec.rounds
    assert delta("specmesh_drafted_tokens_total", method="ngram", arm="spec") == resp.spec.drafted_tokens
    assert delta("specmesh_accepted_tokens_total", method="ngram", arm="spec") == resp.spec.accepted_tokens
    assert delta("specmesh_ttft_seconds_count", arm="spec") == 1 and delta("specmesh_tpot_seconds_count", arm="spec") == 1
    assert delta("specmesh_e2e_seconds_count", arm="spec") == 1 and delta("specmesh_requests_total", arm="spec", code="OK") == 1
    assert delta("specmesh_verify_latency_seconds_count", arm="spec") == resp.spec.rounds
    assert delta("specmesh_completion_tokens_total", arm="spec") == resp.usage.completion_tokens
    assert delta("specmesh_rpc_duration_seconds_count", service="coordinator", method="Generate") == 1
    if resp.spec.drafted_tokens:
        assert delta("specmesh_drafted_per_position_total", method="ngram", position="0", arm="spec") >= 1
        assert delta("specmesh_draft_latency_seconds_count", method="ngram", arm="spec") >= 1
    assert get(after, "specmesh_inflight_requests", service="gateway") == 0
    assert resp.spec.arm == "spec"  # the default share (1): every speculating request is in spec


def test_live_sequences_and_kv_cache_while_a_stream_runs(scraped):
    mesh, scrape = scraped
    call = mesh.gateway_stub.GenerateStream(pb.GenerateRequest(prompt="Count to one hundred.", max_tokens=300),
                                            timeout=300)
    it = iter(call)
    next(it)
    during = scrape()
    call.cancel()
    assert get(during, "specmesh_live_sequences") == 1
    assert get(during, "specmesh_kv_cache_tokens") > 0 and get(during, "specmesh_kv_cache_bytes") > 0
    assert 0 < get(during, "specmesh_kv_cache_usage_ratio") < 1
    assert get(during, "specmesh_inflight_requests", service="coordinator") == 1
    assert wait_until(lambda: get(scrape(), "specmesh_live_sequences") == 0, 30)
    assert wait_until(lambda: get(scrape(), "specmesh_rpc_requests_total", service="gateway",
                                  method="GenerateStream", code="CANCELLED") >= 1, 30)
