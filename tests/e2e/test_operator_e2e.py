"""What an operator points at a running mesh (`specmesh up`: four real processes, /metrics on):
gRPC server reflection on every service (what `grpcurl -plaintext ADDR list | describe` reads), and
every series the Grafana dashboard (compose/grafana/dashboards/specmesh.json) queries, found on the
services' real /metrics pages after a few real requests."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

from specmesh.telemetry.promql import dashboard_queries, exposed_series, queried_series
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e
ROLES = ("gateway", "coordinator", "draft_worker", "target_worker")
BUILTIN = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
SERVES = {"gateway": {"specmesh.v1.Gateway", "specmesh.v1.Admin"},
          "coordinator": {"specmesh.v1.Coordinator", "specmesh.v1.Admin"},
          "draft_worker": {"specmesh.v1.DraftWorker"}, "target_worker": {"specmesh.v1.TargetWorker"}}
FROM_PROMETHEUS = {"up"}
ADDED_LABELS = {"job", "instance", "arm"}  # Prometheus' target labels; the canary's arm (may not exist yet)
REPEAT = "Repeat this line three times: the cat sat on the mat and the dog sat on the log."


@pytest.fixture(scope="module")
def mesh(tmp_path_factory, e2e):
    if not e2e.model_cached():
        pytest.skip("default model not cached (run `specmesh fetch-model`)")
    ports = dict(zip(ROLES, e2e.free_ports(len(ROLES))))
    m = e2e.start_up_mesh(tmp_path_factory.mktemp("operator"),
                          metrics={"host": "127.0.0.1", **{f"{r}_port": p for r, p in ports.items()}})
    try:
        m.wait_started()
        m.wait_healthy()
        with grpc.insecure_channel(m.gateway) as channel:  # a few real requests: spec, AR, a stream
            stub = pb_grpc.GatewayStub(channel)
            for method in ("ngram", "ngram", "off"):
                req = pb.GenerateRequest(prompt=REPEAT, max_tokens=24)
                req.speculation.method = method
                assert stub.Generate(req, timeout=300).token_ids
            assert list(stub.GenerateStream(pb.GenerateRequest(prompt=REPEAT, max_tokens=8), timeout=300))
        yield m, ports
    finally:
        m.terminate()


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def total(page: str, series: str, **labels) -> float:
    """Sum of the samples of `series` whose labels include `labels` (other labels, e.g. arm, summed)."""
    return sum(s.value for fam in text_string_to_metric_families(page) for s in fam.samples
               if s.name == series and all(s.labels.get(k) == v for k, v in labels.items()))


def test_reflection_lists_and_describes_every_real_service(mesh):
    m, _ = mesh
    for role in ROLES:
        with grpc.insecure_channel(m.address(role)) as channel:
            db = ProtoReflectionDescriptorDatabase(channel)
            assert set(db.get_services()) == SERVES[role] | BUILTIN, role
            pool = DescriptorPool(db)
            for service in SERVES[role]:
                assert pool.FindServiceByName(service).methods, service


def test_a_request_built_from_reflection_alone(mesh):
    m, _ = mesh
    with grpc.insecure_channel(m.gateway) as channel:
        method = DescriptorPool(ProtoReflectionDescriptorDatabase(channel)) \
            .FindServiceByName("specmesh.v1.Gateway").methods_by_name["Generate"]
        req_cls, resp_cls = (message_factory.GetMessageClass(t) for t in (method.input_type, method.output_type))
        call = channel.unary_unary("/specmesh.v1.Gateway/Generate", request_serializer=req_cls.SerializeToString,
                                   response_deserializer=resp_cls.FromString)
        resp = call(json_format.ParseDict({"prompt": "Say hi.", "max_tokens": 3}, req_cls()), timeout=300)
    assert 1 <= resp.usage.completion_tokens <= 3


def test_every_dashboard_series_is_on_a_real_metrics_page(mesh, e2e):
    _, ports = mesh
    exposed: dict[str, set[str]] = {}
    for role, port in ports.items():
        for name, labels in exposed_series(scrape(port)).items():
            exposed.setdefault(name, set()).update(labels)
    dashboard = json.loads((e2e.REPO / "compose" / "grafana" / "dashboards" / "specmesh.json").read_text())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 20
    for title, expr in queries:
        for name, labels in queried_series(expr).items():
            if name in FROM_PROMETHEUS:
                continue
            assert name in exposed, f"panel {title!r} queries {name}, which no service's /metrics has"
            if exposed[name]:  # samples seen: the labels it matches on are among theirs
                unknown = labels - exposed[name] - ADDED_LABELS
                assert not unknown, f"panel {title!r}: {name} has no label(s) {sorted(unknown)}"


def test_the_requests_show_in_the_panels_series(mesh):
    _, ports = mesh
    coordinator, target = scrape(ports["coordinator"]), scrape(ports["target_worker"])
    assert total(coordinator, "specmesh_completion_tokens_total") > 0
    assert total(coordinator, "specmesh_ttft_seconds_count") >= 4
    assert total(coordinator, "specmesh_tpot_seconds_count") >= 1
    assert total(coordinator, "specmesh_acceptance_length_count", method="ngram") > 0
    assert total(coordinator, "specmesh_chosen_k_count", method="ngram") > 0
    assert total(coordinator, "specmesh_chosen_k_count", method="off") > 0  # the AR request: k = 0
    assert total(coordinator, "specmesh_drafted_per_position_total", method="ngram", position="0") > 0
    assert 0 <= total(target, "specmesh_kv_cache_usage_ratio") <= 1
    assert "specmesh_live_sequences" in exposed_series(target)
    for role, port in ports.items():
        assert "specmesh_queue_length" in exposed_series(scrape(port)), role
    deadline = time.monotonic() + 10  # the interceptor counts an RPC just after its response left
    while total(scrape(ports["gateway"]), "specmesh_rpc_requests_total", service="gateway", code="OK") < 4:
        assert time.monotonic() < deadline, "the gateway's requests are not in its RPC counter"
        time.sleep(0.2)
