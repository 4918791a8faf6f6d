"""The compose stack's entrypoints, run as local processes with the compose environment.

Each specmesh service of compose/docker-compose.yml is started with its own `command` and
`environment`, only with compose host names mapped to 127.0.0.1 ports (redis -> a redis-server
started here, coordinator -> its local port, otel-collector -> a closed port) and 0.0.0.0 listen
addresses moved to free loopback ports. Test-only additions: torch threads 1 and float32 (a 2-core
shared box). Then the compose health checks must pass and the gateway must serve a request.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import yaml

from specmesh.netutil import free_ports
from specmesh.procutil import wait_or_kill
from specmesh.registry import Registry
from specmesh.registry.local_redis import LocalRedis
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]

REPO = Path(__file__).resolve().parents[2]
ORDER = ("target-worker", "draft-worker", "coordinator", "gateway")
TEST_ONLY_ENV = {"SPECMESH_RUNTIME__TORCH_THREADS": "1", "SPECMESH_MODEL__DTYPE": "float32"}


def _model_cached() -> bool:
    from specmesh.engine.fetch import model_cache_dir

    return (model_cache_dir() / "MANIFEST.sha256").is_file()


def localize(value: str, hosts: dict[str, str]) -> str:
    """Replace compose `service:port` references (and 0.0.0.0 listen addresses) by local 127.0.0.1 ones."""
    if value in hosts:
        return hosts[value]
    return re.sub(r"\b([a-z][a-z0-9-]*):(\d+)\b", lambda m: hosts.get(f"{m[1]}:{m[2]}", m[0]), value)


def probe(cmd: list[str], hosts: dict[str, str]) -> bool:
    args = [localize(a, hosts) for a in cmd[1:]]
    assert args[0] == "specmesh"
    res = subprocess.run([sys.executable, "-m", "specmesh.cli"] + args[1:], capture_output=True, timeout=60)
    return res.returncode == 0


@pytest.fixture(scope="module")
def compose_stack(tmp_path_factory):
    if not _model_cached():
        pytest.skip("default model not cached (run `specmesh fetch-model`)")
    services = yaml.safe_load((REPO / "compose" / "docker-compose.yml").read_text())["services"]
    logs = tmp_path_factory.mktemp("compose_entrypoints")
    ports = dict(zip(ORDER + ("otel-collector",), free_ports(len(ORDER) + 1)))
    procs: dict[str, subprocess.Popen] = {}
    with LocalRedis() as redis_server:
        hosts = {"redis:6379": f"127.0.0.1:{redis_server.port}",
                 "otel-collector:4317": f"127.0.0.1:{ports['otel-collector']}"}  # closed: export fails quietly
        for name in ORDER:
            listen = services[name]["command"][-1]
            hosts[f"{name}:{listen.rsplit(':', 1)[1]}"] = f"127.0.0.1:{ports[name]}"
            hosts[listen] = f"127.0.0.1:{ports[name]}"  # 0.0.0.0:<port> -> a loopback port
            hosts[f"127.0.0.1:{listen.rsplit(':', 1)[1]}"] = f"127.0.0.1:{ports[name]}"  # health checks
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SPECMESH_", "OTEL_")) or k == "SPECMESH_HOME"}
        try:
            for name in ORDER:
                svc = services[name]
                env = dict(base, **{k: localize(str(v), hosts) for k, v in svc["environment"].items()}, **TEST_ONLY_ENV)
                cmd = [localize(a, hosts) for a in svc["command"]]
                assert cmd[0] == "python"
                with open(logs / f"{name}.log", "wb") as out:
                    procs[name] = subprocess.Popen([sys.executable] + cmd[1:], env=env, stdout=out,
                                                   stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO)
            yield {"services": services, "hosts": hosts, "procs": procs, "redis": redis_server.url, "logs": logs,
                   "gateway": hosts["gateway:50051"]}
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs.values():
                wait_or_kill(p, 40)


def _logs(stack) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(stack["logs"].glob("*")))


def test_compose_health_checks_pass(compose_stack):
    deadline = time.monotonic() + 300
    for name in ORDER:
        hc = compose_stack["services"][name]["healthcheck"]["test"]
        while not probe(hc, compose_stack["hosts"]):
            proc = compose_stack["procs"][name]
            assert proc.poll() is None, f"{name} exited {proc.returncode}\n{_logs(compose_stack)}"
            assert time.monotonic() < deadline, f"{name} never healthy\n{_logs(compose_stack)}"
            time.sleep(1.0)


def test_workers_registered_under_their_local_addresses(compose_stack):
    reg = Registry(compose_stack["redis"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (reg.list("target") and reg.list("draft")):
            time.sleep(0.3)
        assert [r.address for r in reg.list("target")] == [compose_stack["hosts"]["target-worker:50054"]]
        (draft,) = reg.list("draft")
        assert draft.address == compose_stack["hosts"]["draft-worker:50053"]
        assert set(draft.methods) == {"ngram", "draft_model"}  # SPECMESH_DRAFT_WORKER__METHODS from compose
    finally:
        reg.close()


def test_gateway_serves_a_request(compose_stack):
    with grpc.insecure_channel(compose_stack["gateway"]) as channel:
        stub = pb_grpc.GatewayStub(channel)
        deadline = time.monotonic() + 60
        while True:  # the coordinator may need one registry poll after the workers came up
            try:
                resp = stub.Generate(pb.GenerateRequest(prompt="Count to five.", max_tokens=8), timeout=120)
                break
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise AssertionError(f"{err.code().name}: {err.details()}\n{_logs(compose_stack)}") from err
                time.sleep(1.0)
    assert len(resp.token_ids) >= 1 and resp.finish_reason in ("length", "eos", "stop")
    assert resp.spec.draft_failures == 0
