"""Gateway servicer: validate the public request, forward to the coordinator. Entry `main`."""

from __future__ import annotations

import dataclasses
import logging
import sys

import grpc

from specmesh.config import ConfigError, MeshConfig
from specmesh.errors import ModelIntegrityError
from specmesh.rpc.errors import raise_from_rpc
from specmesh.rpc.requests import Limits, decode_request
from specmesh.rpc.server import Service, make_channel
from specmesh.runtime import service_args, start_process
from specmesh.tokenization import PromptEncoder, model_encoder
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, cfg: MeshConfig, encoder: PromptEncoder):
        self.cfg = cfg
        self.encoder = encoder
        self.limits = Limits(cfg.gateway.max_tokens_limit, cfg.gateway.max_stop_strings)
        self.coordinator = pb_grpc.CoordinatorStub(make_channel(cfg.gateway.coordinator))

    def _timeout(self, request, context) -> float:
        """Validate every field (INVALID_ARGUMENT names it); the client's deadline, clamped."""
        remaining = context.time_remaining()
        limit = self.cfg.gateway.max_deadline_s
        timeout = limit if remaining is None else min(remaining, limit)
        decode_request(request, self.encoder, self.limits, self.cfg.speculative, timeout)
        return timeout

    def Generate(self, request, context):
        timeout = self._timeout(request, context)
        try:
            return self.coordinator.Generate(request, timeout=timeout)
        except grpc.RpcError as err:
            raise_from_rpc(err, "coordinator")

    def GenerateStream(self, request, context):
        timeout = self._timeout(request, context)
        call = self.coordinator.GenerateStream(request, timeout=timeout)
        context.add_callback(call.cancel)  # client went away: cancel the coordinator's stream too
        try:
            yield from call
        except grpc.RpcError as err:
            raise_from_rpc(err, "coordinator")


def main(argv=None) -> int:
    args = service_args("specmesh gateway", argv)
    try:
        cfg = start_process("gateway", args)
        if args.listen:
            cfg = cfg.replace(gateway=dataclasses.replace(cfg.gateway, listen=args.listen))
        encoder = model_encoder(cfg.model)
    except (ConfigError, ModelIntegrityError) as exc:
        print(f"gateway: refusing to start: {exc}", file=sys.stderr)
        return 2
    servicer = GatewayServicer(cfg, encoder)
    service = Service("specmesh.v1.Gateway", cfg.gateway.listen,
                      lambda s: pb_grpc.add_GatewayServicer_to_server(servicer, s), cfg.gateway.max_workers)
    service.start()
    service.wait_for_signal()
    return 0


if __name__ == "__main__":
    sys.exit(main())
