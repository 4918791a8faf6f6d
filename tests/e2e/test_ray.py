"""`specmesh ray`: the mesh as Ray actors on a local Ray cluster (2 draft + 2 target workers, each
tier on its own custom resource), workers in the registry (a redis-server started here), real
requests through the gateway, env / trace context reaching the service processes, run-time scaling.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import yaml

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (make setup installs it)")

from specmesh.netutil import free_port  # noqa: E402
from specmesh.registry import Registry  # noqa: E402
from specmesh.registry.local_redis import LocalRedis  # noqa: E402
from specmesh.v1 import specmesh_pb2 as pb  # noqa: E402
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc  # noqa: E402

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
PROMPTS = ["Count from 1 to 12, separated by commas.", "Name three colours.", "Spell the word banana.",
           "List the days of the week."]


def _model_cached() -> bool:
    from specmesh.engine.fetch import model_cache_dir

    return (model_cache_dir() / "MANIFEST.sha256").is_file()


@pytest.fixture(scope="module")
def ray_mesh():
    if not _model_cached():
        pytest.skip("default model not cached (run `specmesh fetch-model`)")
    from specmesh.ray import mesh
    from specmesh.ray.env import actor_env

    gw, co = free_port(), free_port()
    config = {"model": {"dtype": "float32"}, "runtime": {"torch_threads": 1, "log_level": "WARNING"},
              "gateway": {"listen": f"127.0.0.1:{gw}", "coordinator": f"127.0.0.1:{co}"},
              "coordinator": {"listen": f"127.0.0.1:{co}", "local_ngram": False},  # n-gram over the draft tier
              "draft_worker": {"methods": ["ngram"]},
              "registry": {"heartbeat_interval_s": 0.5, "ttl_s": 3.0, "poll_interval_s": 0.3}}
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray on loopback only (node IP 127.0.0.1)
    with LocalRedis() as redis_server:
        ray.init(num_cpus=8, resources={"draft_gpu": 2, "target_gpu": 2}, _node_ip_address="127.0.0.1",
                 include_dashboard=False, object_store_memory=80 * 1024 * 1024, namespace=mesh.NAMESPACE,
                 log_to_driver=False, logging_level="ERROR")  # (_node_ip_address alone is re-resolved off loopback)
        try:
            env = actor_env(environ={"OTEL_SERVICE_NAME": "specmesh-ray-test", "TRACEPARENT": TRACEPARENT,
                                     "SPECMESH_RUNTIME__LOG_LEVEL": "WARNING", "UNRELATED": "x"})
            spec = mesh.RayMeshSpec(
                redis_url=redis_server.url, config_text=yaml.safe_dump(config), env=env, host="127.0.0.1",
                gateway_port=gw, coordinator_port=co, start_timeout_s=300,
                tiers={"target": mesh.TierSpec(2, 1, 0, {"target_gpu": 1}),
                       "draft": mesh.TierSpec(2, 1, 0, {"draft_gpu": 1}),
                       "coordinator": mesh.TierSpec(1, 1), "gateway": mesh.TierSpec(1, 1)})
            replicas = mesh.up(spec)
            yield {"replicas": replicas, "redis": redis_server.url, "gateway": f"127.0.0.1:{gw}", "config": config}
        finally:
            try:
                mesh.down()
            finally:
                ray.shutdown()
                os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)


def _registered(url: str, tier: str) -> list:
    reg = Registry(url)
    try:
        return [r for r in reg.list(tier) if not r.draining]
    finally:
        reg.close()


def test_tiers_run_as_actors_on_their_own_resources(ray_mesh):
    from specmesh.ray import mesh

    tiers = sorted(r["tier"] for r in mesh.status() if r["alive"])
    assert tiers == ["coordinator", "draft", "draft", "gateway", "target", "target"]
    avail = ray.available_resources()
    assert avail.get("draft_gpu", 0) == 0 and avail.get("target_gpu", 0) == 0  # each replica holds one
    assert len(_registered(ray_mesh["redis"], "target")) == 2
    assert len(_registered(ray_mesh["redis"], "draft")) == 2


def test_serves_concurrent_requests_identical_to_target_alone(ray_mesh):
    stub = pb_grpc.GatewayStub(grpc.insecure_channel(ray_mesh["gateway"]))

    def run(prompt, method):
        req = pb.GenerateRequest(prompt=prompt, max_tokens=16)
        req.sampling.temperature = 0.0
        req.speculation.method = method
        if method != "off":  # a fixed k: every round drafts on the draft tier, whose routing this tests
            req.speculation.num_speculative_tokens = 4  # (goodput may pick k = 0 for a whole 16-token request)
        return stub.Generate(req, timeout=300)

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        spec = list(pool.map(lambda p: run(p, "ngram"), PROMPTS))
        off = list(pool.map(lambda p: run(p, "off"), PROMPTS))
    for a, b in zip(spec, off):
        assert a.finish_reason in ("length", "eos") and len(a.token_ids) >= 1
        assert list(a.token_ids) == list(b.token_ids)
    time.sleep(1.0)  # one heartbeat: the counters are published
    served = {r.address: r.load.get("served", 0) for r in _registered(ray_mesh["redis"], "draft")}
    assert all(n > 0 for n in served.values()), served  # rounds went to both draft workers


def test_env_and_trace_context_reach_the_service_processes(ray_mesh):
    from specmesh.ray import mesh

    for replica in mesh.status():
        environ = Path(f"/proc/{replica['pid']}/environ").read_bytes().split(b"\0")
        env = dict(e.decode(errors="replace").split("=", 1) for e in environ if b"=" in e)
        assert env.get("OTEL_SERVICE_NAME") == "specmesh-ray-test", replica
        assert env.get("TRACEPARENT") == TRACEPARENT
        assert env.get("SPECMESH_REGISTRY__URL") == ray_mesh["redis"]
        assert "UNRELATED" not in env


def test_scale_draft_tier_at_run_time(ray_mesh):
    from specmesh.ray import mesh

    mesh.scale("draft", 1)
    deadline = time.monotonic() + 30
    while len(_registered(ray_mesh["redis"], "draft")) != 1 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert len(_registered(ray_mesh["redis"], "draft")) == 1
    while ray.available_resources().get("draft_gpu", 0) != 1 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert ray.available_resources().get("draft_gpu", 0) == 1  # the removed replica gave its resource back
    stub = pb_grpc.GatewayStub(grpc.insecure_channel(ray_mesh["gateway"]))
    resp = stub.Generate(pb.GenerateRequest(prompt="Say hi.", max_tokens=4), timeout=300)
    assert len(resp.token_ids) >= 1 and resp.spec.draft_failures == 0
