"""TargetWorker servicer: decode protobuf -> TargetEngine -> encode. Entry point `main`."""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading

from specmesh.config import ConfigError
from specmesh.engine.loader import load_configured_model
from specmesh.errors import ModelIntegrityError
from specmesh.rpc.convert import proposal_from_pb, sampling_from_pb
from specmesh.rpc.server import Service
from specmesh.runtime import service_args, start_process
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc
from target_worker.engine import TargetEngine

log = logging.getLogger(__name__)


class TargetWorkerServicer(pb_grpc.TargetWorkerServicer):
    def __init__(self, engine: TargetEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def Prefill(self, request, context):
        token = self.engine.prefill(request.seq_id, list(request.prompt), sampling_from_pb(request.sampling),
                                    timeout=context.time_remaining())
        return pb.PrefillResponse(token_id=token)

    def Verify(self, request, context):
        draft = proposal_from_pb(request.draft_token_ids, request.draft_probs, request.vocab_size)
        out = self.engine.verify(request.seq_id, draft, timeout=context.time_remaining())
        return pb.VerifyResponse(accepted=out.accepted, token_ids=out.tokens, bonus=out.bonus)

    def Release(self, request, context):
        return pb.ReleaseResponse(released=self.engine.release(request.seq_id))

    def Status(self, request, context):
        return pb.WorkerStatusResponse(
            live_sequences=self.engine.live_sequences(),
            kv_cache_bytes=self.engine.kv_bytes(),
            queue_length=self.engine.batcher.qsize(),
            model=self.model_name,
            vocab_size=self.engine.vocab_size,
        )


def _reclaimer(engine: TargetEngine, interval_s: float, stop: threading.Event) -> None:
    while not stop.wait(interval_s):
        engine.reclaim_idle()


def main(argv=None) -> int:
    args = service_args("specmesh target worker", argv)
    try:
        cfg = start_process("target_worker", args)
        wcfg = cfg.target_worker if not args.listen else dataclasses.replace(cfg.target_worker, listen=args.listen)
        model_dir, model = load_configured_model(cfg.model.name, cfg.model.path, cfg.model.dtype,
                                                 cfg.model.require_manifest)
    except (ConfigError, ModelIntegrityError) as exc:
        print(f"target_worker: refusing to start: {exc}", file=sys.stderr)
        return 2
    c = wcfg.cache
    engine = TargetEngine(model, wcfg.max_batch_size, c.max_sequences, c.max_tokens, c.idle_timeout_s)
    servicer = TargetWorkerServicer(engine, str(model_dir))
    service = Service("specmesh.v1.TargetWorker", wcfg.listen,
                      lambda s: pb_grpc.add_TargetWorkerServicer_to_server(servicer, s), wcfg.max_workers)
    stop = threading.Event()
    threading.Thread(target=_reclaimer, args=(engine, c.reclaim_interval_s, stop), daemon=True).start()
    service.start()
    service.wait_for_signal(on_stop=lambda: (stop.set(), engine.close()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
