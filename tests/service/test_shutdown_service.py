"""Backpressure, deadlines, cancellation, readiness and graceful stop with real gRPC servers.

Fake coordinator / drafter where the model is beside the point; the real mesh (in-process, the
session's model) where the KV cache must be freed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from prod_helpers import (FakeCoordinator, Started, gateway_stub, live_sequences, make_config,
                          start_fake_coordinator, start_gateway, start_mesh, wait_until)
from specmesh.core.types import DraftProposal
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

pytestmark = pytest.mark.service


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status


SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def gated(prompt_encoder):
    """A gateway (max 1 in flight, 1 queued) in front of a coordinator that blocks until gate.set()."""
    started, gate = Started(), threading.Event()
    fake = FakeCoordinator(completion=3, gate=gate)
    coordinator = start_fake_coordinator(fake, started)
    cfg = make_config({"gateway": {"coordinator": coordinator},
                       "backpressure": {"gateway": {"max_inflight": 1, "max_queue": 1, "queue_timeout_s": 60}}})
    servicer, svc = start_gateway(cfg, prompt_encoder, started)
    yield servicer, svc, fake, gate, gateway_stub(svc.listen, started)
    gate.set()
    started.stop()


def test_gateway_in_flight_and_queue_limits_then_unavailable_at_once(gated):
    servicer, _, fake, gate, stub = gated
    r = pb.GenerateRequest(prompt="hi", max_tokens=3)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(stub.Generate, r, timeout=60)
        assert fake.entered.acquire(timeout=30)  # in flight at the coordinator
        second = pool.submit(lambda: list(stub.GenerateStream(r, timeout=60)))
        assert wait_until(lambda: servicer.admission.waiting == 1)  # queued at the gateway
        with pytest.raises(grpc.RpcError) as exc:
            stub.Generate(r, timeout=60)  # beyond both: refused without waiting
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE and "overloaded" in exc.value.details()
        assert not first.done() and not second.done()
        gate.set()
        assert first.result(60).finish_reason == "length"
        assert second.result(60)[-1].finish_reason == "length"


def test_graceful_stop_finishes_in_flight_refuses_new(gated):
    servicer, svc, fake, gate, stub = gated
    r = pb.GenerateRequest(prompt="hi", max_tokens=3)
    with ThreadPoolExecutor(2) as pool:
        stream = pool.submit(lambda: list(stub.GenerateStream(r, timeout=60)))
        assert fake.entered.acquire(timeout=30)
        stopper = pool.submit(svc.stop, 30.0)
        assert wait_until(lambda: svc.draining)
        with pytest.raises(grpc.RpcError) as exc:
            stub.Generate(r, timeout=10)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
        gate.set()
        chunks = stream.result(60)
        assert chunks[-1].finish_reason == "length" and len(chunks) == 3
        stopper.result(60)


class SlowDrafter:
    def __init__(self, gate):
        self.gate = gate

    def propose(self, job, timeout=None):
        self.gate.wait(30)
        return DraftProposal([1] * job.k)

    def release(self, seq_id):
        pass


def test_worker_refuses_beyond_its_limit():
    from draft_worker.server import DraftWorkerServicer
    from specmesh.rpc.server import Service
    from specmesh.telemetry.workers import admission_limiter

    cfg = make_config({"backpressure": {"draft_worker": {"max_inflight": 1, "max_queue": 0}}})
    gate = threading.Event()
    servicer = DraftWorkerServicer({"ngram": SlowDrafter(gate)}, 16,
                                   admission_limiter("draft_worker", cfg.backpressure.draft_worker))
    svc = Service("specmesh.v1.DraftWorker", "127.0.0.1:0",
                  lambda s: pb_grpc.add_DraftWorkerServicer_to_server(servicer, s), 8).start()
    try:
        with grpc.insecure_channel(svc.listen) as ch, ThreadPoolExecutor(1) as pool:
            stub = pb_grpc.DraftWorkerStub(ch)
            p = pb.ProposeRequest(seq_id="s", context=[1, 2, 3], num_tokens=2, method="ngram")
            busy = pool.submit(stub.Propose, p, timeout=60)
            assert wait_until(lambda: servicer.admission.inflight == 1)
            with pytest.raises(grpc.RpcError) as exc:
                stub.Propose(p, timeout=60)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
            gate.set()
            assert list(busy.result(60).token_ids) == [1, 1]
    finally:
        gate.set()
        svc.stop(0.5)


@pytest.fixture(scope="module")
def mesh(target_model, prompt_encoder):
    m = start_mesh(target_model, prompt_encoder, {"health": {"probe_interval_s": 0.5, "startup_retry_s": 0.2}})
    yield m
    m.stop()


def test_deadline_exceeded_frees_the_sequence(mesh):
    with pytest.raises(grpc.RpcError) as exc:
        mesh.gateway_stub.Generate(pb.GenerateRequest(prompt="Tell me a long story about a dragon.",
                                                      max_tokens=500), timeout=2.0)
    assert exc.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_until(lambda: live_sequences(mesh) == 0, 30)


def test_client_cancel_mid_stream_stops_generation_and_frees_kv(mesh):
    call = mesh.gateway_stub.GenerateStream(pb.GenerateRequest(prompt="Count from one to one thousand.",
                                                               max_tokens=500), timeout=300)
    it = iter(call)
    next(it)
    next(it)
    assert live_sequences(mesh) == 1
    call.cancel()
    assert wait_until(lambda: live_sequences(mesh) == 0, 30)
    jobs = mesh.engine.batcher.jobs_run
    time.sleep(1.5)
    assert mesh.engine.batcher.jobs_run == jobs  # nothing is generating any more


def test_gateway_serving_only_while_the_mesh_probe_succeeds(mesh, prompt_encoder):
    from gateway.health import MeshProbe
    from specmesh.rpc.server import Service

    svc = Service("specmesh.v1.Gateway", "127.0.0.1:0", lambda s: None, 4, ready_on_start=False).start()
    probe = None
    try:
        assert health(svc.listen) == NOT_SERVING  # starting
        probe = MeshProbe(mesh.gateway.coordinator, svc.set_serving, mesh.cfg.health).start()
        assert wait_until(lambda: health(svc.listen) == SERVING, 60)
        assert probe.ok
        probe.stop()
        dead = MeshProbe(pb_grpc.CoordinatorStub(grpc.insecure_channel("127.0.0.1:1")), svc.set_serving,
                         mesh.cfg.health)
        assert dead.check_once() is False  # no mesh behind it: the next probe turns it NOT_SERVING
        svc.set_serving(dead.ok)
        assert health(svc.listen) == NOT_SERVING
        svc.set_serving(True)
        svc.draining = True
        svc.set_serving(True)  # a late probe result cannot undo draining
        assert health(svc.listen) == NOT_SERVING
    finally:
        if probe:
            probe.stop()
        svc.stop(0.5)
