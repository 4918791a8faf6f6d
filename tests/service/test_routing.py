"""Routing with the registry: two target workers and two draft workers as REAL in-process gRPC
servers (one shared model), registered in a redis-server started here, a coordinator fed by the
registry watcher. Sequences spread over the targets, rounds over the drafts; a draining target
takes no new sequence; a target that dies mid-sequence costs nothing (re-prefill elsewhere)."""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.service,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]

PROMPTS = ["Count from 1 to 10, separated by commas.", "Name three colours.", "Write the word hello twice.",
           "List four animals."]
MAX_TOKENS = 12


class Mesh:
    def __init__(self, cfg, model, encoder):
        from coordinator.clients import pools_from_config
        from coordinator.server import CoordinatorServicer

        self.cfg, self.model = cfg, model
        self.targets, self.drafts, self.services = [], [], []
        self.pools = pools_from_config(cfg)
        servicer = CoordinatorServicer(cfg, encoder, self.pools[0], self.pools[1])
        self.coordinator = self._serve("specmesh.v1.Coordinator",
                                       lambda s: pb_grpc.add_CoordinatorServicer_to_server(servicer, s))
        self.channel = grpc.insecure_channel(self.coordinator.listen)
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    def _serve(self, name, register, cls=None):
        from specmesh.rpc.server import Service

        service = (cls or Service)(name, "127.0.0.1:0", register, 16).start()
        self.services.append(service)
        return service

    def add_target(self):
        from specmesh.registry.worker import DrainingService
        from target_worker.engine import TargetEngine
        from target_worker.server import TargetWorkerServicer, lifecycle_for

        w = self.cfg.target_worker
        engine = TargetEngine(self.model, w.max_batch_size, w.cache.max_sequences, w.cache.max_tokens, 60.0)
        servicer = TargetWorkerServicer(engine, "test-target")
        service = self._serve("specmesh.v1.TargetWorker",
                              lambda s: pb_grpc.add_TargetWorkerServicer_to_server(servicer, s), DrainingService)
        life = lifecycle_for(self.cfg, w, servicer, "test-target").attach(service)
        self.targets.append((service, engine, life))
        return self.targets[-1]

    def add_draft(self):
        from draft_worker.drafters import NgramDrafter
        from draft_worker.server import DraftWorkerServicer, lifecycle_for
        from specmesh.registry.worker import DrainingService

        servicer = DraftWorkerServicer({"ngram": NgramDrafter(1, 4)}, 16)
        service = self._serve("specmesh.v1.DraftWorker",
                              lambda s: pb_grpc.add_DraftWorkerServicer_to_server(servicer, s), DrainingService)
        life = lifecycle_for(self.cfg, self.cfg.draft_worker, servicer).attach(service)
        self.drafts.append((service, servicer, life))
        return self.drafts[-1]

    def wait_members(self, targets: int, drafts: int, timeout=10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            usable_t = [m for m in self.pools[0].members.snapshot() if not m.draining]
            usable_d = [m for m in self.pools[1].members.snapshot() if not m.draining]
            if len(usable_t) == targets and len(usable_d) == drafts:
                return
            time.sleep(0.05)
        raise AssertionError(f"coordinator never saw {targets} targets / {drafts} drafts")

    def generate(self, prompt, stream=False):
        req = pb.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS)
        req.sampling.temperature = 0.0
        req.speculation.method = "ngram"
        # a fixed k: rounds draft on the draft tier this tests (goodput's k = 0 rounds would burst
        # and leave short requests only the odd probe)
        req.speculation.num_speculative_tokens = 4
        if not stream:
            return list(self.stub.Generate(req, timeout=300).token_ids)
        return self.stub.GenerateStream(req, timeout=300)

    def stop(self):
        self.channel.close()
        if self.pools[2] is not None:
            self.pools[2].stop()
        for service in reversed(self.services):
            life = getattr(service, "lifecycle", None)
            if life is not None:
                life.deregister()
            service.server.stop(0)
        for _, engine, _ in self.targets:
            engine.close()


@pytest.fixture
def mesh(target_model, prompt_encoder):
    from specmesh.config import load_config
    from specmesh.registry.local_redis import LocalRedis

    with LocalRedis() as redis_server:
        cfg = load_config(environ={}, overrides={
            "runtime": {"log_level": "WARNING"},
            "registry": {"url": redis_server.url, "heartbeat_interval_s": 0.2, "ttl_s": 1.5, "poll_interval_s": 0.1},
            "target_worker": {"drain_timeout_s": 30.0},
            "coordinator": {"draft_retry_after_s": 1.0, "local_ngram": False}})  # n-gram over the draft tier
        m = Mesh(cfg, target_model, prompt_encoder)
        try:
            yield m
        finally:
            m.stop()


@pytest.fixture
def references(hf_reference):
    return {p: hf_reference(p, max_tokens=MAX_TOKENS).token_ids for p in PROMPTS}


def test_sequences_spread_over_targets_and_rounds_over_drafts(mesh, references):
    for _ in range(2):
        mesh.add_target()
        mesh.add_draft()
    mesh.wait_members(2, 2)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(mesh.generate, PROMPTS * 2))
    assert results == [references[p] for p in PROMPTS * 2]
    prefills = [engine.batcher.jobs_run for _, engine, _ in mesh.targets]
    assert all(n > 0 for n in prefills), prefills  # both targets held sequences
    assert all(s.served > 0 for _, s, _ in mesh.drafts), [s.served for _, s, _ in mesh.drafts]


def test_worker_started_later_joins_and_a_silent_one_is_dropped(mesh, references):
    mesh.add_target()
    mesh.wait_members(1, 0)
    assert mesh.generate(PROMPTS[0]) == references[PROMPTS[0]]  # no draft worker: target alone
    _, servicer, life = mesh.add_draft()
    mesh.wait_members(1, 1, timeout=3)  # joined within a few polls, nothing restarted
    assert mesh.generate(PROMPTS[1]) == references[PROMPTS[1]]
    assert servicer.served > 0
    life.registration._stop.set()  # the heartbeat stops (a hung or partitioned worker)
    mesh.wait_members(1, 0, timeout=5)  # dropped after the TTL


def test_draining_target_takes_no_new_sequences_but_finishes_live_ones(mesh, references):
    (svc_a, engine_a, life_a), (_, engine_b, _) = mesh.add_target(), mesh.add_target()
    mesh.add_draft()
    mesh.wait_members(2, 1)
    streams = [mesh.generate(p, stream=True) for p in PROMPTS]
    firsts = [next(s) for s in streams]  # every sequence is prefilled somewhere
    live_on_a = engine_a.live_sequences()
    drain = threading.Thread(target=life_a.drain)
    drain.start()
    mesh.wait_members(1, 1)  # A is draining: out of the pool for new sequences
    jobs_a = engine_a.batcher.jobs_run
    assert mesh.generate(PROMPTS[0]) == references[PROMPTS[0]]
    rest = [[t for c in s for t in c.token_ids] for s in streams]
    assert [list(f.token_ids) + r for f, r in zip(firsts, rest)] == [references[p] for p in PROMPTS]
    drain.join(30)
    assert not drain.is_alive() and engine_a.live_sequences() == 0
    assert engine_a.batcher.jobs_run - jobs_a <= live_on_a * MAX_TOKENS  # only its own live sequences' rounds
    assert engine_b.batcher.jobs_run > 0


def test_target_dying_mid_sequence_is_reprefilled_elsewhere(mesh, references):
    (svc_a, engine_a, life_a), _ = mesh.add_target(), mesh.add_target()
    mesh.add_draft()
    mesh.wait_members(2, 1)
    streams = [mesh.generate(p, stream=True) for p in PROMPTS]
    firsts = [next(s) for s in streams]
    assert engine_a.live_sequences() > 0
    life_a.registration._stop.set()  # killed: no drain, no deregistration
    svc_a.server.stop(0)  # connections drop at once
    rest = [[t for c in s for t in c.token_ids] for s in streams]
    assert [list(f.token_ids) + r for f, r in zip(firsts, rest)] == [references[p] for p in PROMPTS]
