"""DraftWorker servicer: decode protobuf -> drafter -> encode. Entry point `main`."""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time

from draft_worker.block_loader import head_vocab_ids, load_block_model
from draft_worker.drafters import BlockDrafter, NgramDrafter, ProposeJob
from draft_worker.model_drafter import ModelDrafter
from specmesh.config import ConfigError, MeshConfig
from specmesh.engine import cpu_gemm, quant  # quant.quantize: cached, its bytes for the log
from specmesh.engine.loader import load_draft_model
from specmesh.errors import InvalidArgument, ModelIntegrityError
from specmesh.config import MAX_SEQ_ID_CHARS, MAX_TREE_BUDGET
from specmesh.rpc.convert import candidates_to_pb, checked_sampling_from_pb, features_from_pb, probs_to_wire
from specmesh.registry.worker import DrainingService, WorkerLifecycle
from specmesh.rpc.admission import deadline_from
from specmesh.rpc.server import service_options
from specmesh.runtime import service_args, start_process
from specmesh.telemetry.tracing import set_attributes
from specmesh.telemetry.workers import admission_limiter, watch_batcher, watch_drafter_caches
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_CONTEXT_TOKENS = 1 << 17  # a drafter without a context window of its own (n-gram) reads at most this many
MAX_BUDGET_S = 3600.0  # ProposeRequest.budget_s


class DraftWorkerServicer(pb_grpc.DraftWorkerServicer):
    def __init__(self, drafters: dict, max_k: int, admission=None):
        self.drafters = drafters
        self.max_k = max_k
        self.admission = admission  # an AdmissionLimiter for Propose (None: unlimited)
        self.inflight = 0  # Propose calls running now (published as load with a registry)
        self.served = 0  # Propose calls answered since start
        self._count_lock = threading.Lock()

    def Propose(self, request, context):
        with self._count_lock:
            self.inflight += 1
        try:
            if self.admission is None:
                return self._propose(request, context)
            with self.admission.slot(deadline_from(context)):
                return self._propose(request, context)
        finally:
            with self._count_lock:
                self.inflight -= 1
                self.served += 1

    def _propose(self, request, context):
        drafter = self.drafters.get(request.method)
        if drafter is None:
            raise InvalidArgument("method", f"{request.method!r} is not served here (have: {', '.join(self.drafters)})")
        if not 0 <= request.num_tokens <= self.max_k:
            raise InvalidArgument("num_tokens", f"must be in [0, {self.max_k}]")
        if not request.context:
            raise InvalidArgument("context", "must hold at least one token")
        if not 0 <= request.tree_budget <= MAX_TREE_BUDGET:
            raise InvalidArgument("tree_budget", f"must be in [0, {MAX_TREE_BUDGET}]")
        if not 0 <= request.budget_s <= MAX_BUDGET_S:  # NaN fails too
            raise InvalidArgument("budget_s", f"must be in [0, {MAX_BUDGET_S}] seconds")
        if len(request.seq_id) > MAX_SEQ_ID_CHARS:
            raise InvalidArgument("seq_id", f"at most {MAX_SEQ_ID_CHARS} characters")
        if request.candidates and not (getattr(drafter, "drafts_candidates", False) and request.tree_budget > 0):
            raise InvalidArgument("candidates", "needs a drafter that drafts its positions in parallel (block) "
                                                "and tree_budget > 0 (the table's width)")
        _check_context(drafter, request.context)
        job = ProposeJob(request.seq_id, list(request.context), request.num_tokens,
                         checked_sampling_from_pb(request.sampling), request.round,
                         features_from_pb(request.features), request.features_complete, request.tree_budget,
                         alive=context.is_active,
                         stop_at=time.monotonic() + request.budget_s if request.budget_s > 0 else 0.0,
                         candidates=request.candidates)
        draft = drafter.propose(job, timeout=context.time_remaining())
        set_attributes({"specmesh.drafter": request.method, "specmesh.seq_id": request.seq_id,
                        "specmesh.num_speculative_tokens": request.num_tokens,
                        "specmesh.drafted_tokens": len(draft.token_ids)})
        vocab = getattr(drafter, "vocab_size", 0) if draft.probs is not None else 0
        dense, sparse = probs_to_wire(draft.probs)  # a truncated proposal travels sparse
        return pb.ProposeResponse(token_ids=draft.token_ids, probs=dense, sparse_probs=sparse, vocab_size=vocab,
                                  features_missing=draft.missing_features, parents=draft.parents or [],
                                  candidates=candidates_to_pb(draft.candidates))

    def Release(self, request, context):
        for drafter in self.drafters.values():
            drafter.release(request.seq_id)
        return pb.ReleaseDraftResponse()


def _check_context(drafter, context) -> None:
    """A model drafter reads at most its context window of ids in its vocabulary (n-gram matches
    ids as opaque integers, up to MAX_CONTEXT_TOKENS)."""
    window = getattr(drafter, "context_window", None) or MAX_CONTEXT_TOKENS
    if len(context) > window:
        raise InvalidArgument("context", f"{len(context)} tokens; this drafter reads at most {window}")
    vocab = getattr(drafter, "vocab_size", None)
    if vocab and (min(context) < 0 or max(context) >= vocab):
        raise InvalidArgument("context", f"token ids must be in [0, {vocab})")


def build_drafters(cfg: MeshConfig) -> dict:
    wcfg = cfg.draft_worker
    drafters: dict = {}
    if "ngram" in wcfg.methods:
        drafters["ngram"] = NgramDrafter(wcfg.ngram.min_n, wcfg.ngram.max_n)
    if "draft_model" in wcfg.methods:
        dm = wcfg.draft_model
        _, model, setup = load_draft_model(cfg)
        if setup["cpu_kernel"]:
            log.info("draft_model: CPU kernel on (%.0f MB packed)", cpu_gemm.packed_bytes(model) / 1e6)
        if dm.weights == "int8":
            log.info("draft_model: %s", f"int8 weights for drafting steps ({quant.quantize(model) / 1e6:.0f} MB)"
                     if setup["weights"] == "int8" else f"int8 kernel unusable here; drafting in {model.dtype}")
        bp = cfg.backpressure.draft_worker
        drafters["draft_model"] = ModelDrafter(model, wcfg.max_batch_size, wcfg.cache_max_sequences,
                                               proposal_top_k=dm.proposal_top_k,
                                               max_queue=bp.max_inflight + bp.max_queue,
                                               cache_max_tokens=wcfg.cache_max_tokens)
    if "block" in wcfg.methods:
        block = load_block_model(cfg)  # None: the default artefact is absent (logged)
        if block is not None:
            bp = cfg.backpressure.draft_worker
            drafters["block"] = BlockDrafter(block, wcfg.max_batch_size, wcfg.cache_max_sequences,
                                             max_queue=bp.max_inflight + bp.max_queue,
                                             cpu_kernel=wcfg.block.cpu_kernel,
                                             head_ids=head_vocab_ids(cfg, block.cfg.vocab_size))
            log.info("block: %s LM head over %d tokens%s", block.lm_head.weight.dtype,
                     drafters["block"].head.weight.shape[0], " from packed weights (CPU kernel)"
                     if drafters["block"].cpu_kernel else ", linears oneDNN-prepacked" if drafters["block"].prepacked else "")
    return drafters


def lifecycle_for(cfg, wcfg, servicer: DraftWorkerServicer) -> WorkerLifecycle:
    """Registration (methods, load) and drain: coordinators stop routing rounds here, then stop."""
    return WorkerLifecycle(
        cfg.registry, "draft", model=cfg.model.path or cfg.model.name, methods=tuple(servicer.drafters),
        capacity={"max_batch_size": wcfg.max_batch_size},
        load_fn=lambda: {"inflight": servicer.inflight, "served": servicer.served, "queue": 0},
        is_idle=lambda: servicer.inflight == 0, drain_timeout_s=5.0)


def main(argv=None) -> int:
    args = service_args("specmesh draft worker", argv)
    try:
        cfg = start_process("draft_worker", args)
        wcfg = cfg.draft_worker if not args.listen else dataclasses.replace(cfg.draft_worker, listen=args.listen)
        drafters = build_drafters(cfg)
    except (ConfigError, ModelIntegrityError) as exc:
        print(f"draft_worker: refusing to start: {exc}", file=sys.stderr)
        return 2
    bp = cfg.backpressure.draft_worker
    servicer = DraftWorkerServicer(drafters, cfg.speculative.max_speculative_tokens,
                                   admission_limiter("draft_worker", bp))
    watch_drafter_caches(drafters)
    if "draft_model" in drafters:
        watch_batcher("draft_worker", drafters["draft_model"].batcher)
    if "block" in drafters and "draft_model" not in drafters:
        watch_batcher("draft_worker", drafters["block"].batcher)
    service = DrainingService("specmesh.v1.DraftWorker", wcfg.listen,
                              lambda s: pb_grpc.add_DraftWorkerServicer_to_server(servicer, s), wcfg.max_workers,
                              **service_options(cfg, "draft_worker"))
    service.start()
    lifecycle_for(cfg, wcfg, servicer).attach(service)
    service.wait_for_signal(on_stop=lambda: [d.close() for d in drafters.values()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
