"""TargetWorker servicer: decode protobuf -> TargetEngine -> encode. Entry point `main`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading

from specmesh.config import MAX_DRAFT_TOKENS, ConfigError
from specmesh.engine import attention, cpu_gemm, exactrow, onednn, rowexact
from specmesh.engine.loader import dtype_name, load_configured_model
from specmesh.engine.manifest import model_fingerprint
from specmesh.errors import InvalidArgument, ModelIntegrityError, Unavailable
from specmesh.registry.worker import DrainingService, WorkerLifecycle
from specmesh.rpc.convert import (checked_sampling_from_pb, cost_to_pb, feature_request_from_pb, features_to_pb,
                                  ngram_burst_from_pb, proposal_from_pb)
from specmesh.rpc.admission import deadline_from
from specmesh.rpc.server import service_options
from specmesh.runtime import service_args, start_process
from specmesh.telemetry.tracing import set_attributes
from specmesh.telemetry.workers import admission_limiter, watch_target_engine
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
from target_worker.engine import TargetEngine

log = logging.getLogger(__name__)


class TargetWorkerServicer(pb_grpc.TargetWorkerServicer):
    def __init__(self, engine: TargetEngine, model_name: str, admission=None):
        self.engine = engine
        self.model_name = model_name
        self.admission = admission  # an AdmissionLimiter for Prefill/Verify (None: unlimited)
        self.draining = False  # SIGTERM: no new sequence; live ones finish

    def Prefill(self, request, context):
        if self.draining:
            raise Unavailable("target worker is draining; the sequence goes to another worker")
        set_attributes({"specmesh.seq_id": request.seq_id, "specmesh.prompt_tokens": len(request.prompt)})
        features = feature_request_from_pb(request)  # None: no features asked, none computed
        params = checked_sampling_from_pb(request.sampling)
        with self._slot(context):
            out = self.engine.prefill_outcome(request.seq_id, list(request.prompt), params,
                                              timeout=context.time_remaining(), features=features,
                                              max_new_tokens=max(0, request.max_new_tokens))
        return pb.PrefillResponse(token_id=out.token, features=features_to_pb(out.features),
                                  verify_cost=cost_to_pb(self._cost()))

    def Verify(self, request, context):
        self._check_draft_size(request)
        draft = proposal_from_pb(request.draft_token_ids, request.draft_probs, request.vocab_size,
                                 request.draft_parents,
                                 sparse=request.draft_sparse_probs if request.HasField("draft_sparse_probs") else None,
                                 accept=request.draft_accept)
        features = feature_request_from_pb(request)
        with self._slot(context):
            out = self.engine.verify(request.seq_id, draft, timeout=context.time_remaining(), features=features,
                                     steps=max(1, request.decode_steps), ngram=ngram_burst_from_pb(request))
        set_attributes({"specmesh.seq_id": request.seq_id, "specmesh.drafted_tokens": len(draft.token_ids),
                        "specmesh.accepted_tokens": out.accepted, "specmesh.bonus": out.bonus})
        return pb.VerifyResponse(accepted=out.accepted, token_ids=out.tokens, bonus=out.bonus,
                                 cache_length=self.engine.cache_length(request.seq_id),
                                 features=features_to_pb(out.features),
                                 verify_cost=cost_to_pb(self._cost()),
                                 step_drafted=[d for d, _ in out.steps or ()],
                                 step_accepted=[a for _, a in out.steps or ()], trimmed_tokens=out.trimmed)

    def _cost(self) -> dict:
        """The verify cost model as sent: the table, the mean batch and the live sequences now."""
        return {**self.engine.cost.as_dict(), "live": self.engine.live_sequences()}

    def _check_draft_size(self, request) -> None:
        """Before anything is decoded: a draft of at most MAX_DRAFT_TOKENS tokens, and probabilities
        over this worker's vocabulary only (a [k, vocab_size] tensor is allocated from them)."""
        if len(request.draft_token_ids) > MAX_DRAFT_TOKENS:
            raise InvalidArgument("draft_token_ids", f"at most {MAX_DRAFT_TOKENS} draft tokens")
        has_probs = bool(request.draft_probs) or bool(request.draft_sparse_probs.row_lengths)
        if has_probs and request.vocab_size != self.engine.vocab_size:
            raise InvalidArgument("vocab_size", f"{request.vocab_size} is not this model's ({self.engine.vocab_size})")

    def _slot(self, context):
        return self.admission.slot(deadline_from(context)) if self.admission is not None else contextlib.nullcontext()

    def Release(self, request, context):
        return pb.ReleaseResponse(released=self.engine.release(request.seq_id))

    def Status(self, request, context):
        return pb.WorkerStatusResponse(
            live_sequences=self.engine.live_sequences(),
            kv_cache_bytes=self.engine.kv_bytes(),
            queue_length=self.engine.batcher.qsize(),
            model=self.model_name,
            vocab_size=self.engine.vocab_size,
            verify_cost=cost_to_pb(self._cost()),
        )


def _reclaimer(engine: TargetEngine, interval_s: float, stop: threading.Event) -> None:
    while not stop.wait(interval_s):
        engine.reclaim_idle()


def lifecycle_for(cfg, wcfg, servicer: TargetWorkerServicer, model: str, fingerprint: str = "") -> WorkerLifecycle:
    """Registration (capacity + load) and drain: refuse new sequences, wait for live ones."""
    engine = servicer.engine

    def load() -> dict:
        return {"live_sequences": engine.live_sequences(), "held_tokens": engine.held_tokens(),
                "queue": engine.batcher.qsize(), "verify_cost": engine.cost.as_dict()}

    return WorkerLifecycle(
        cfg.registry, "target", model=model, fingerprint=fingerprint, load_fn=load,
        capacity={"max_sequences": wcfg.cache.max_sequences, "max_tokens": wcfg.cache.max_tokens,
                  "max_batch_size": wcfg.max_batch_size},
        begin_drain=lambda: setattr(servicer, "draining", True),
        # idle: nothing held, or nothing touched for 3 s (its coordinator is gone; the reclaimer frees it)
        is_idle=lambda: engine.idle_for() > 3.0,
        drain_timeout_s=wcfg.drain_timeout_s)


def main(argv=None) -> int:
    args = service_args("specmesh target worker", argv)
    try:
        cfg = start_process("target_worker", args)
        wcfg = cfg.target_worker if not args.listen else dataclasses.replace(cfg.target_worker, listen=args.listen)
        model_dir, model = load_configured_model(cfg.model.name, cfg.model.path, cfg.model.dtype,
                                                 cfg.model.require_manifest, cfg.model.device)
    except (ConfigError, ModelIntegrityError) as exc:
        print(f"target_worker: refusing to start: {exc}", file=sys.stderr)
        return 2
    c, bp = wcfg.cache, cfg.backpressure.target_worker
    opts = service_options(cfg, "target_worker")
    engine = TargetEngine(model, wcfg.max_batch_size, c.max_sequences, c.max_tokens, c.idle_timeout_s,
                          max_queue=bp.max_inflight + bp.max_queue, batch_invariant=wcfg.batch_invariant,
                          cpu_kernel=wcfg.cpu_kernel, batch_gather=wcfg.batch_gather,
                          attention_fold=wcfg.attention_fold, draft_trim=wcfg.draft_trim,
                          bf16_rows=wcfg.bf16_rows)
    param = next(model.parameters())
    log.info("target %s (%s) loaded: %s on %s, KV pool %d tokens (%.1f MB), CPU verify kernel %s (%.1f MB packed), "
             "batch_invariant %s -> %s%s", model_dir, model_fingerprint(model_dir) or "no manifest", dtype_name(param.dtype), param.device, engine.pool.max_tokens,
             engine.pool.nbytes() / 1e6, engine.cpu_kernel, cpu_gemm.packed_bytes(model) / 1e6,
             wcfg.batch_invariant, engine.batch_invariant,
             f" (probed: batched rows bitwise the {'2-row-floor' if engine.row_exact == 2 else 'one-row'} calls "
             f"up to {rowexact.probed(model, max(1, engine.row_exact))})" if rowexact.is_installed(model) else "")
    log.info("oneDNN-prepacked bf16 linears (%.1f MB; engine.md#onednn): %s", onednn.packed_bytes(model) / 1e6,
             getattr(model, "_specmesh_onednn_report", {}) or "none")
    log.info("verify cost model (rows -> seconds, measured at start): %s", engine.measure_cost())
    log.info("one-token attention, grouped heads as rows (attention_fold %s): %s; on the exact kernel "
             "(exactrow.py): %s", wcfg.attention_fold, attention.decisions(), exactrow.decisions())
    watch_target_engine(engine)
    servicer = TargetWorkerServicer(engine, str(model_dir), admission_limiter("target_worker", bp))
    service = DrainingService("specmesh.v1.TargetWorker", wcfg.listen,
                              lambda s: pb_grpc.add_TargetWorkerServicer_to_server(servicer, s), wcfg.max_workers,
                              **opts)
    stop = threading.Event()
    threading.Thread(target=_reclaimer, args=(engine, c.reclaim_interval_s, stop), daemon=True).start()
    service.start()
    lifecycle_for(cfg, wcfg, servicer, str(model_dir), model_fingerprint(model_dir)).attach(service)
    service.wait_for_signal(on_stop=lambda: (stop.set(), engine.close()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
