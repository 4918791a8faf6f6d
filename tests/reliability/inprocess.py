"""The reliability tier's mesh: the four REAL servicers in this process, on free loopback ports,
wired as the entry points wire them (service_options: mTLS on the mesh ports, the public port's
message limit, metrics on loopback), a real redis-server holding the API keys (auth required),
and the session's loaded model. Its interface is the suite's (specmesh.reliability.harness): the
fuzz runner, limits and security checks run against it unchanged. Log lines (JSON, DEBUG and up)
and spans are captured in memory for the no-text check."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from specmesh.reliability.harness import KEY_PREFIX, SuiteMesh, _merge, suite_config


class Captured(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        from specmesh.logs import JsonFormatter

        self.setFormatter(JsonFormatter("inprocess"))
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


@dataclass
class InProcessMesh(SuiteMesh):
    services: dict = field(default_factory=dict)
    closers: list = field(default_factory=list)
    captured: Captured | None = None
    spans: object = None  # an InMemorySpanExporter
    root_level: int = logging.WARNING
    gateway_servicer: object = None
    drafters: dict = field(default_factory=dict)

    def draft_cache(self) -> tuple[int, int]:
        kept = [d for d in self.drafters.values() if hasattr(d, "cached_sequences")]
        return sum(d.cached_sequences() for d in kept), sum(d.cached_tokens() for d in kept)

    def dead(self) -> list[str]:
        return [name for name, svc in self.services.items() if svc._stopped.is_set()]

    def pids(self) -> dict[str, int]:
        return {"pytest (all four services)": os.getpid()}

    def logs(self) -> str:
        spans = [s.to_json(indent=None) for s in self.spans.get_finished_spans()] if self.spans else []
        return "\n".join(self.captured.lines + spans)

    def stop(self) -> None:
        from specmesh.rpc.server import configure_mesh_tls

        for name in ("gateway", "coordinator", "draft_worker", "target_worker"):
            if name in self.services:
                self.services[name].stop(grace_s=1.0)
        for close in self.closers:
            close()
        configure_mesh_tls(None)
        if self.captured is not None:
            logging.getLogger().removeHandler(self.captured)
            logging.getLogger().setLevel(self.root_level)
        if self.redis is not None:
            self.redis.stop()


def _capture(mesh: InProcessMesh) -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from specmesh.telemetry import tracing

    mesh.captured = Captured()
    root = logging.getLogger()
    mesh.root_level = root.level
    root.addHandler(mesh.captured)
    root.setLevel(logging.DEBUG)
    for noisy in ("urllib3", "filelock", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    tracing.setup_tracing("inprocess")
    if tracing.provider() is not None:
        mesh.spans = InMemorySpanExporter()
        tracing.provider().add_span_processor(SimpleSpanProcessor(mesh.spans))


def _servicers(mesh: InProcessMesh, target_model, encoder) -> dict:
    from coordinator.admin import CoordinatorAdminServicer
    from coordinator.clients import TargetPool
    from coordinator.draftpool import GrpcDraftPool
    from coordinator.server import CoordinatorServicer
    from draft_worker.block_loader import load_block_model
    from draft_worker.drafters import BlockDrafter, NgramDrafter
    from draft_worker.model_drafter import ModelDrafter
    from draft_worker.server import DraftWorkerServicer
    from gateway.admin import GatewayAdminServicer
    from gateway.server import GatewayServicer
    from specmesh.auth.guard import Guard
    from specmesh.telemetry.workers import admission_limiter
    from specmesh.v1 import admin_pb2_grpc as apb_grpc
    from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
    from target_worker.engine import TargetEngine
    from target_worker.server import TargetWorkerServicer

    cfg, bp = mesh.cfg, mesh.cfg.backpressure
    w, dw, c = cfg.target_worker, cfg.draft_worker, cfg.coordinator
    engine = TargetEngine(target_model, w.max_batch_size, w.cache.max_sequences, w.cache.max_tokens,
                          w.cache.idle_timeout_s, max_queue=64, batch_invariant=w.batch_invariant)
    drafters = {"ngram": NgramDrafter(dw.ngram.min_n, dw.ngram.max_n),
                "draft_model": ModelDrafter(target_model, dw.max_batch_size, dw.cache_max_sequences,
                                            proposal_top_k=dw.draft_model.proposal_top_k)}
    block = load_block_model(cfg, target_model.get_input_embeddings(), target_model.get_output_embeddings())
    if block is not None:
        drafters["block"] = BlockDrafter(block, dw.max_batch_size, dw.cache_max_sequences)
    mesh.closers += [engine.close] + [d.close for d in drafters.values()]
    mesh.drafters = drafters
    target = TargetWorkerServicer(engine, "test-target", admission_limiter("target_worker", bp.target_worker))
    draft = DraftWorkerServicer(drafters, cfg.speculative.max_speculative_tokens,
                                admission_limiter("draft_worker", bp.draft_worker))
    coordinator = CoordinatorServicer(cfg, encoder, TargetPool(c.target_workers),
                                      GrpcDraftPool(c.draft_workers, c.draft_retry_after_s))
    gateway = mesh.gateway_servicer = GatewayServicer(cfg, encoder, Guard.from_config(cfg, environ={}))

    def reg_coordinator(s):
        pb_grpc.add_CoordinatorServicer_to_server(coordinator, s)
        apb_grpc.add_AdminServicer_to_server(CoordinatorAdminServicer.of(coordinator), s)

    def reg_gateway(s):
        pb_grpc.add_GatewayServicer_to_server(gateway, s)
        apb_grpc.add_AdminServicer_to_server(GatewayAdminServicer(gateway.guard, gateway.admins), s)

    return {"target_worker": ("specmesh.v1.TargetWorker", lambda s: pb_grpc.add_TargetWorkerServicer_to_server(target, s)),
            "draft_worker": ("specmesh.v1.DraftWorker", lambda s: pb_grpc.add_DraftWorkerServicer_to_server(draft, s)),
            "coordinator": ("specmesh.v1.Coordinator", reg_coordinator),
            "gateway": ("specmesh.v1.Gateway", reg_gateway)}


def start_inprocess(workdir: Path, target_model, encoder, overrides: dict | None = None) -> InProcessMesh:
    from specmesh.auth.store import KeyStore, connect
    from specmesh.config import load_config
    from specmesh.registry.local_redis import LocalRedis
    from specmesh.reliability.pki import make_suite_pki
    from specmesh.rpc.server import Service, configure_mesh_tls, service_options

    redis = LocalRedis().start()
    mesh = InProcessMesh(workdir, {}, None, None, redis=redis)
    try:
        mesh.pki = make_suite_pki(workdir / "pki")
        mesh.data = suite_config(redis.url, mesh.pki, _merge({"draft_worker": {"max_workers": 16}}, overrides or {}))
        mesh.cfg = load_config(environ={}, overrides=mesh.data)
        store = KeyStore(connect(redis.url), KEY_PREFIX)
        mesh.keys = {name: store.create(name, admin=name == "admin")[0] for name in ("user", "other", "admin")}
        _capture(mesh)
        configure_mesh_tls(mesh.cfg.tls.mesh)  # before any channel: the coordinator's and gateway's are mTLS
        for role, (name, register) in _servicers(mesh, target_model, encoder).items():
            opts = service_options(mesh.cfg, role)  # first: mesh mTLS on for the servers and channels made next
            section = getattr(mesh.cfg, role)
            mesh.services[role] = Service(name, section.listen, register, 16, **opts).start()
    except BaseException:
        mesh.stop()
        raise
    return mesh
