"""The gateway's gRPC front (specmesh.v1.Gateway) and its entry point `main`.

The request path itself (auth, validation, admission, rate limits, the coordinator call,
cancellation) is gateway.core; this servicer only reads the transport's facts (the Bearer key,
the deadline, the client going away) and hands them over. With `http.listen` set the same
process also serves the OpenAI-compatible HTTP front (gateway.http) on that core.
"""

from __future__ import annotations

import dataclasses
import sys

from gateway.admin import GatewayAdminServicer
from gateway.core import GatewayCore
from gateway.health import MeshProbe
from specmesh.auth.keys import bearer_token
from specmesh.config import ConfigError
from specmesh.errors import ModelIntegrityError
from specmesh.rpc.server import Service, service_options
from specmesh.runtime import service_args, start_process
from specmesh.tokenization import model_encoder
from specmesh.v1 import admin_pb2_grpc as apb_grpc
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc


class GatewayServicer(GatewayCore, pb_grpc.GatewayServicer):
    def _admit(self, request, context):
        record = self.authenticate(bearer_token(context.invocation_metadata()))
        return self.admit(request, record, context.time_remaining(), context.peer())

    def Generate(self, request, context):
        return self.generate(self._admit(request, context), context.add_callback)

    def GenerateStream(self, request, context):
        yield from self.stream(self._admit(request, context), context.add_callback)


def main(argv=None) -> int:
    args = service_args("specmesh gateway", argv)
    try:
        cfg = start_process("gateway", args)
        if args.listen:
            cfg = cfg.replace(gateway=dataclasses.replace(cfg.gateway, listen=args.listen))
        encoder = model_encoder(cfg.model)
        opts = service_options(cfg, "gateway")  # before any channel: mesh mTLS
    except (ConfigError, ModelIntegrityError, OSError) as exc:
        print(f"gateway: refusing to start: {exc}", file=sys.stderr)
        return 2
    servicer = GatewayServicer(cfg, encoder)
    http = None
    if cfg.http.listen:  # the OpenAI-compatible front, on the same core (bound first: a taken port fails here)
        from gateway.http.serve import HttpFront

        try:
            http = HttpFront(cfg, servicer).start()
        except (OSError, RuntimeError) as exc:
            print(f"gateway: refusing to start: http.listen {cfg.http.listen}: {exc}", file=sys.stderr)
            return 2

    def register(server) -> None:
        pb_grpc.add_GatewayServicer_to_server(servicer, server)
        apb_grpc.add_AdminServicer_to_server(GatewayAdminServicer(servicer.guard, servicer.admins), server)

    service = Service("specmesh.v1.Gateway", cfg.gateway.listen, register, cfg.gateway.max_workers,
                      ready_on_start=False, **opts)  # NOT_SERVING until the mesh probe succeeds
    service.start()
    probe = MeshProbe(servicer.coordinator, service.set_serving, cfg.health).start()
    if http is None:
        service.wait_for_signal(on_drain=probe.stop)
        return 0
    http.state.ready = lambda: probe.ok is True

    def drain() -> None:
        probe.stop()
        http.drain()  # new HTTP requests: 503; in-flight ones finish while gRPC's drain

    service.wait_for_signal(on_drain=drain, on_stop=lambda: http.stop(cfg.shutdown.grace_s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
