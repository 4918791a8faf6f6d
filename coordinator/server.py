"""Coordinator servicer: decode GenerateRequest -> Generation loop -> encode chunks. Entry `main`."""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

from coordinator import observe
from coordinator.admin import CoordinatorAdminServicer
from coordinator.canary import CanaryBook, CanaryGuard
from coordinator.clients import TargetPool, pools_from_config
from coordinator.draftpool import GrpcDraftPool
from coordinator.control import SpeculationControl
from coordinator.loop import Generation
from specmesh.core.canary import CONTROL, Canary
from specmesh.core.goodput import RateBook
from specmesh.core.pace import PaceBook
from specmesh.core.ngram import NgramLookup, propose_ngram
from specmesh.core.types import FeatureSpec, GenerationRequest
from specmesh.config import ConfigError, MeshConfig
from specmesh.engine.loader import resolve_model_dir
from specmesh.engine.manifest import model_fingerprint
from specmesh.errors import ModelIntegrityError
from specmesh.registry.worker import WorkerLifecycle
from specmesh.rpc.convert import stats_to_pb
from specmesh.rpc.requests import Limits, decode_request
from specmesh.rpc.admission import deadline_from
from specmesh.rpc.server import Service, service_options
from specmesh.runtime import service_args, start_process
from specmesh.telemetry import context as reqctx
from specmesh.telemetry.workers import admission_limiter
from specmesh.tokenization import PromptEncoder, model_encoder
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import admin_pb2_grpc as apb_grpc
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, cfg: MeshConfig, encoder: PromptEncoder, targets: TargetPool, drafts: GrpcDraftPool,
                 control: SpeculationControl | None = None):
        self.cfg, self.encoder, self.targets, self.drafts = cfg, encoder, targets, drafts
        self.limits = Limits.from_config(cfg.gateway)
        # the admin hot switch and canary (served by CoordinatorAdminServicer), the canary's
        # per-arm windows (admin canary) and guard, and backpressure
        canary = Canary(cfg.coordinator.canary.share, cfg.coordinator.canary.keys)
        self.canary_book = CanaryBook(canary)
        self.control = control or SpeculationControl(cfg.speculative.max_speculative_tokens,
                                                     on_change=self._speculation_changed, canary=canary)
        observe.speculation_changed(self.control.state)  # the gauges at start
        self.guard = _guard(cfg.coordinator.canary, self.control)
        self.admission = admission_limiter("coordinator", cfg.backpressure.coordinator)
        self.model = observe.model_name(cfg)
        spec = cfg.speculative  # what the block drafter reads: asked of the target, sent on to the draft tier
        self.feature_spec = FeatureSpec(tuple(spec.feature_layers), spec.feature_window)
        # per-drafter acceptance rates, seeding each request's goodput k; the measured pace of
        # drafting vs the target alone (speculative.pace_gate)
        self.rate_book = RateBook(pace=PaceBook() if spec.pace_gate else None)
        # pre-drafting (coordinator.overlap_drafting) and block tables (coordinator.block_tables): one
        # Propose in flight per request at most
        c = cfg.coordinator
        self.predraft_pool = (ThreadPoolExecutor(c.max_workers, thread_name_prefix="predraft")
                              if c.overlap_drafting or c.block_tables else None)
        ng = cfg.draft_worker.ngram  # n-gram drafts here, next to the context: no Propose hop
        self.local_drafters = {"ngram": NgramLookup(ng.min_n, ng.max_n)} if cfg.coordinator.local_ngram else {}
        self.lookup = (ng.min_n, ng.max_n) if cfg.coordinator.local_ngram and cfg.coordinator.ngram_bursts else None
        g = cfg.coordinator.ngram_graft  # block trees carry an n-gram draft on a match of >= g tokens
        self.graft = (lambda context, k: propose_ngram(context, k, g, max(g, ng.max_n))) if g else None

    def _speculation_changed(self, state) -> None:
        observe.speculation_changed(state)
        self.canary_book.changed(state)

    def _arm(self, req: GenerationRequest) -> tuple[GenerationRequest, str]:
        """The request's canary arm, chosen once; a control request runs with speculation off."""
        info = reqctx.current()
        arm = self.control.arm(req.request_id, info.key_name if info else "", speculates=req.method != "off")
        if info is not None:
            info.arm = arm  # on this span, the access line, and forwarded to the workers' spans
        if arm == CONTROL and req.method != "off":
            req = dataclasses.replace(req, method="off", k=0, k_max=0)
        return req, arm

    def _generation(self, request, context) -> tuple[Generation, str]:
        left, limit = context.time_remaining(), self.cfg.gateway.max_deadline_s  # clamped here too
        req: GenerationRequest = decode_request(request, self.encoder, self.limits, self.cfg.speculative,
                                                limit if left is None else min(left, limit))
        req, arm = self._arm(req)
        c = self.cfg.coordinator
        return Generation(req, self.targets.pick(prompt_tokens=len(req.prompt_ids)), self.drafts,
                          self.encoder.tokenizer, self.encoder.eos_token_ids, c.draft_timeout_s, context.is_active,
                          reroute=lambda tried: self.targets.pick(exclude=tried, prompt_tokens=len(req.prompt_ids)),
                          max_reroutes=c.max_target_failovers, target_timeout_s=c.target_call_timeout_s,
                          control=self.control, observer=functools.partial(observe.on_round, arm=arm),
                          feature_spec=self.feature_spec, rate_book=self.rate_book,
                          local_drafters=self.local_drafters,
                          overlap=self.predraft_pool if c.overlap_drafting else None,
                          tables=self.predraft_pool if c.block_tables else None,
                          decode_steps=c.decode_steps, lookup=self.lookup, fresh_tables=c.fresh_tables,
                          graft=self.graft), arm

    def _final(self, gen: Generation, tel, cls, **fields):
        usage = pb.Usage(prompt_tokens=len(gen.req.prompt_ids), completion_tokens=len(gen.out.token_ids))
        spec = stats_to_pb(gen.stats, gen.method)
        spec.arm = tel.arm
        return cls(finish_reason=gen.out.finish_reason or "", usage=usage, spec=spec,
                   request_id=gen.req.request_id, **fields)

    def Generate(self, request, context):
        with self.admission.slot(deadline_from(context)):
            gen, arm = self._generation(request, context)
            tel = observe.RequestTelemetry(gen, self.model, request.raw, self.control, arm)
            failed = None
            try:
                for _ in gen.run():
                    pass
            except BaseException as exc:
                failed = exc
                raise
            finally:
                tel.finish(failed)
            return self._final(gen, tel, pb.GenerateResponse, text=gen.out.text, token_ids=gen.out.token_ids)

    def GenerateStream(self, request, context):
        with self.admission.slot(deadline_from(context)):
            gen, arm = self._generation(request, context)
            tel = observe.RequestTelemetry(gen, self.model, request.raw, self.control, arm)
            failed = None
            try:
                for chunk in gen.run():
                    if chunk.finish_reason:
                        yield self._final(gen, tel, pb.GenerateChunk, text=chunk.text, token_ids=chunk.token_ids)
                    elif chunk.token_ids or chunk.text:
                        yield pb.GenerateChunk(text=chunk.text, token_ids=chunk.token_ids,
                                               request_id=gen.req.request_id)
            except BaseException as exc:
                failed = exc
                raise
            finally:
                tel.finish(failed)


def _guard(ccfg, control: SpeculationControl) -> CanaryGuard | None:
    """coordinator.canary.guard_margin set: the guard thread, started; null: None."""
    if ccfg.guard_margin is None:
        return None
    return CanaryGuard(control, ccfg.guard_margin, ccfg.guard_min_requests, ccfg.guard_interval_s).start()


def main(argv=None) -> int:
    args = service_args("specmesh coordinator", argv)
    try:
        cfg = start_process("coordinator", args)
        ccfg = cfg.coordinator if not args.listen else dataclasses.replace(cfg.coordinator, listen=args.listen)
        encoder = model_encoder(cfg.model)
    except (ConfigError, ModelIntegrityError) as exc:
        print(f"coordinator: refusing to start: {exc}", file=sys.stderr)
        return 2
    opts = service_options(cfg, "coordinator")  # first: turns mesh mTLS on for the channels made next
    targets, drafts, watcher = pools_from_config(cfg, ccfg, model_fingerprint(resolve_model_dir(cfg.model.name,
                                                                                                cfg.model.path)))
    servicer = CoordinatorServicer(cfg, encoder, targets, drafts)

    def register(server) -> None:
        pb_grpc.add_CoordinatorServicer_to_server(servicer, server)
        apb_grpc.add_AdminServicer_to_server(CoordinatorAdminServicer.of(servicer), server)

    service = Service("specmesh.v1.Coordinator", ccfg.listen, register, ccfg.max_workers, **opts)
    service.start()
    presence = WorkerLifecycle(cfg.registry, "coordinator").attach(service)  # listed in the registry, if any
    service.wait_for_signal(on_stop=lambda: (presence.deregister(), watcher and watcher.stop()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
