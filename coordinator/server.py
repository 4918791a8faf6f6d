"""Coordinator servicer: decode GenerateRequest -> Generation loop -> encode chunks. Entry `main`."""

from __future__ import annotations

import dataclasses
import logging
import sys

from coordinator.clients import GrpcDraftPool, TargetPool
from coordinator.loop import Generation
from specmesh.core.types import GenerationRequest
from specmesh.config import ConfigError, MeshConfig
from specmesh.errors import ModelIntegrityError
from specmesh.rpc.convert import stats_to_pb
from specmesh.rpc.requests import Limits, decode_request
from specmesh.rpc.server import Service
from specmesh.runtime import service_args, start_process
from specmesh.tokenization import PromptEncoder, model_encoder
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, cfg: MeshConfig, encoder: PromptEncoder, targets: TargetPool, drafts: GrpcDraftPool):
        self.cfg, self.encoder, self.targets, self.drafts = cfg, encoder, targets, drafts
        self.limits = Limits(cfg.gateway.max_tokens_limit, cfg.gateway.max_stop_strings)

    def _generation(self, request, context) -> Generation:
        req: GenerationRequest = decode_request(request, self.encoder, self.limits, self.cfg.speculative,
                                                context.time_remaining())
        return Generation(req, self.targets.pick(), self.drafts, self.encoder.tokenizer,
                          self.encoder.eos_token_ids, self.cfg.coordinator.draft_timeout_s, context.is_active)

    def _final(self, gen: Generation, cls, **fields):
        usage = pb.Usage(prompt_tokens=len(gen.req.prompt_ids), completion_tokens=len(gen.out.token_ids))
        return cls(finish_reason=gen.out.finish_reason or "", usage=usage,
                   spec=stats_to_pb(gen.stats, gen.method), request_id=gen.req.request_id, **fields)

    def Generate(self, request, context):
        gen = self._generation(request, context)
        for _ in gen.run():
            pass
        return self._final(gen, pb.GenerateResponse, text=gen.out.text, token_ids=gen.out.token_ids)

    def GenerateStream(self, request, context):
        gen = self._generation(request, context)
        for chunk in gen.run():
            if chunk.finish_reason:
                yield self._final(gen, pb.GenerateChunk, text=chunk.text, token_ids=chunk.token_ids)
            elif chunk.token_ids or chunk.text:
                yield pb.GenerateChunk(text=chunk.text, token_ids=chunk.token_ids, request_id=gen.req.request_id)


def main(argv=None) -> int:
    args = service_args("specmesh coordinator", argv)
    try:
        cfg = start_process("coordinator", args)
        ccfg = cfg.coordinator if not args.listen else dataclasses.replace(cfg.coordinator, listen=args.listen)
        encoder = model_encoder(cfg.model)
    except (ConfigError, ModelIntegrityError) as exc:
        print(f"coordinator: refusing to start: {exc}", file=sys.stderr)
        return 2
    servicer = CoordinatorServicer(cfg, encoder, TargetPool(ccfg.target_workers),
                                   GrpcDraftPool(ccfg.draft_workers, ccfg.draft_retry_after_s))
    service = Service("specmesh.v1.Coordinator", ccfg.listen,
                      lambda s: pb_grpc.add_CoordinatorServicer_to_server(servicer, s), ccfg.max_workers)
    service.start()
    service.wait_for_signal()
    return 0


if __name__ == "__main__":
    sys.exit(main())
