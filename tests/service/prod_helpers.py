"""Helpers for the production-gateway service tests (auth, rate limits, backpressure, TLS,
telemetry, admin): a real redis-server on a free port, a fake coordinator (no model), a gateway
started with the real servicer, test certificates, and a full in-process mesh with the admin
service wired the way the entry points wire it."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest

from prod_pki import Pki, make_pki  # noqa: F401  (re-exported for the TLS tests)
from specmesh.netutil import free_port  # also imported from here by the e2e tests
from specmesh.procutil import stop_process
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc


# ---------------------------------------------------------------------------- redis

class RedisServer:
    """Our own redis-server (never 6379), no persistence; stopped by stop()."""

    def __init__(self):
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        import redis

        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        stop_process(self.proc, 10)


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


def dead_redis_url() -> str:
    """A URL where nothing listens (a port that was free a moment ago)."""
    return f"redis://127.0.0.1:{free_port()}/0"


# ---------------------------------------------------------------------------- config

def make_config(overrides: dict | None = None):
    from specmesh.config import load_config

    base = {"runtime": {"log_level": "INFO"}, "draft_worker": {"methods": ["ngram"]}}
    return load_config(environ={}, overrides=_merge(base, overrides or {}))


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ---------------------------------------------------------------------------- fake coordinator

class FakeCoordinator(pb_grpc.CoordinatorServicer):
    """Answers at once with `completion` tokens, or blocks on `gate` first; records metadata."""

    def __init__(self, completion: int | None = None, gate: threading.Event | None = None):
        self.completion, self.gate = completion, gate
        self.metadata: list[dict] = []
        self.entered = threading.Semaphore(0)  # released once per call that started

    def _begin(self, request, context) -> int:
        self.metadata.append(dict(context.invocation_metadata()))
        self.entered.release()
        if self.gate is not None:
            self.gate.wait(60)
        return request.max_tokens if self.completion is None else min(self.completion, request.max_tokens)

    def Generate(self, request, context):
        n = self._begin(request, context)
        return pb.GenerateResponse(text="ok" * n, token_ids=[7] * n, finish_reason="length",
                                   usage=pb.Usage(prompt_tokens=3, completion_tokens=n),
                                   spec=pb.SpecStats(method="ngram", rounds=n), request_id=request.request_id)

    def GenerateStream(self, request, context):
        n = self._begin(request, context)
        for i in range(n):
            last = i == n - 1
            yield pb.GenerateChunk(text="ok", token_ids=[7], request_id=request.request_id,
                                   finish_reason="length" if last else "",
                                   usage=pb.Usage(prompt_tokens=3, completion_tokens=n) if last else None)


@dataclass
class Started:
    services: list = field(default_factory=list)
    channels: list = field(default_factory=list)

    def stop(self) -> None:
        for ch in self.channels:
            ch.close()
        for s in reversed(self.services):
            s.stop(0.5)


def start_fake_coordinator(fake: FakeCoordinator, started: Started, credentials="mesh") -> str:
    from specmesh.rpc.server import Service

    svc = Service("specmesh.v1.Coordinator", "127.0.0.1:0",
                  lambda s: pb_grpc.add_CoordinatorServicer_to_server(fake, s), 16, credentials=credentials).start()
    started.services.append(svc)
    return svc.listen


def start_gateway(cfg, encoder, started: Started, guard=None, **service_kwargs):
    """The real GatewayServicer + admin on a free port (the public options as the entry point sets)."""
    from gateway.admin import GatewayAdminServicer
    from gateway.server import GatewayServicer
    from specmesh.rpc.server import Service
    from specmesh.v1 import admin_pb2_grpc as apb_grpc

    servicer = GatewayServicer(cfg, encoder, guard=guard)

    def register(server):
        pb_grpc.add_GatewayServicer_to_server(servicer, server)
        apb_grpc.add_AdminServicer_to_server(GatewayAdminServicer(servicer.guard, servicer.admins), server)

    service_kwargs.setdefault("public", True)
    bp = cfg.backpressure.gateway
    svc = Service("specmesh.v1.Gateway", "127.0.0.1:0", register, 16,
                  min_workers=bp.max_inflight + bp.max_queue + 8, **service_kwargs).start()
    started.services.append(svc)
    return servicer, svc


def gateway_stub(address: str, started: Started, credentials=None, server_name: str | None = None):
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = grpc.secure_channel(address, credentials, options=options) if credentials is not None \
        else grpc.insecure_channel(address)
    started.channels.append(channel)
    return pb_grpc.GatewayStub(channel)


def bearer(key: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {key}")]


# ---------------------------------------------------------------------------- full in-process mesh

@dataclass
class Mesh:
    cfg: object
    started: Started
    engine: object = None
    gateway: object = None  # GatewayServicer
    coordinator: object = None  # CoordinatorServicer
    services: dict = field(default_factory=dict)  # role -> Service
    gateway_stub: object = None
    admin_stub: object = None
    target_stub: object = None

    def stop(self) -> None:
        self.started.stop()
        if self.engine is not None:
            self.engine.close()


def start_mesh(target_model, encoder, overrides: dict | None = None, guard=None) -> Mesh:
    """Target worker, draft worker (ngram), coordinator + admin, gateway + admin: wired as the
    entry points wire them (admission limiters, speculation control, telemetry), on free ports."""
    from coordinator.admin import CoordinatorAdminServicer
    from coordinator.clients import TargetPool
    from coordinator.draftpool import GrpcDraftPool
    from coordinator.server import CoordinatorServicer
    from draft_worker.drafters import NgramDrafter
    from draft_worker.server import DraftWorkerServicer
    from specmesh.rpc.server import Service, make_channel
    from specmesh.telemetry.workers import admission_limiter
    from specmesh.v1 import admin_pb2_grpc as apb_grpc
    from target_worker.engine import TargetEngine
    from target_worker.server import TargetWorkerServicer

    ports = {r: free_port() for r in ("target_worker", "draft_worker", "coordinator", "gateway")}
    addr = {r: f"127.0.0.1:{p}" for r, p in ports.items()}
    cfg = make_config(_merge({
        "gateway": {"listen": addr["gateway"], "coordinator": addr["coordinator"]},
        "coordinator": {"listen": addr["coordinator"], "draft_workers": [addr["draft_worker"]],
                        "target_workers": [addr["target_worker"]], "local_ngram": False},  # n-gram over the draft tier
        "draft_worker": {"listen": addr["draft_worker"]},
        "target_worker": {"listen": addr["target_worker"]},
    }, overrides or {}))
    mesh = Mesh(cfg, Started())
    try:
        w = cfg.target_worker
        mesh.engine = TargetEngine(target_model, w.max_batch_size, w.cache.max_sequences, w.cache.max_tokens,
                                   w.cache.idle_timeout_s, max_queue=64, batch_invariant=w.batch_invariant)
        tservicer = TargetWorkerServicer(mesh.engine, "test-target",
                                         admission_limiter("target_worker", cfg.backpressure.target_worker))
        dservicer = DraftWorkerServicer({"ngram": NgramDrafter(1, 4)}, cfg.speculative.max_speculative_tokens,
                                        admission_limiter("draft_worker", cfg.backpressure.draft_worker))
        c = cfg.coordinator
        mesh.coordinator = CoordinatorServicer(cfg, encoder, TargetPool(c.target_workers),
                                               GrpcDraftPool(c.draft_workers, c.draft_retry_after_s))

        def reg_coordinator(s):
            pb_grpc.add_CoordinatorServicer_to_server(mesh.coordinator, s)
            apb_grpc.add_AdminServicer_to_server(CoordinatorAdminServicer.of(mesh.coordinator), s)

        for role, name, register in (
                ("target_worker", "specmesh.v1.TargetWorker", lambda s: pb_grpc.add_TargetWorkerServicer_to_server(tservicer, s)),
                ("draft_worker", "specmesh.v1.DraftWorker", lambda s: pb_grpc.add_DraftWorkerServicer_to_server(dservicer, s)),
                ("coordinator", "specmesh.v1.Coordinator", reg_coordinator)):
            svc = Service(name, addr[role], register, 16, min_workers=140).start()
            mesh.started.services.append(svc)
            mesh.services[role] = svc
        mesh.gateway, mesh.services["gateway"] = start_gateway(cfg, encoder, mesh.started, guard=guard)
        from specmesh.v1 import admin_pb2_grpc

        channel = grpc.insecure_channel(mesh.services["gateway"].listen)
        mesh.started.channels.append(channel)
        mesh.gateway_stub = pb_grpc.GatewayStub(channel)
        mesh.admin_stub = admin_pb2_grpc.AdminStub(channel)
        tchannel = make_channel(addr["target_worker"])
        mesh.started.channels.append(tchannel)
        mesh.target_stub = pb_grpc.TargetWorkerStub(tchannel)
    except BaseException:
        mesh.stop()
        raise
    return mesh


def start_http(mesh: Mesh, listen: str = "127.0.0.1:0"):
    """The OpenAI-compatible HTTP front on the mesh's gateway core (as `http.listen` starts it in
    the gateway process), on a free port; stopped with the mesh. Returns the HttpFront (.url)."""
    from gateway.http.serve import HttpFront

    front = HttpFront(mesh.cfg, mesh.gateway, listen).start()
    mesh.started.services.append(front)
    return front


def live_sequences(mesh: Mesh) -> int:
    return mesh.target_stub.Status(pb.WorkerStatusRequest(), timeout=10).live_sequences


def wait_until(predicate, timeout_s: float = 30.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
