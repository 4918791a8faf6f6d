"""gRPC server reflection (grpc.reflection.v1alpha.ServerReflection) for every specmesh server.

specmesh.rpc.server.Service hands its `register` callback a ServiceRecorder instead of the bare
grpc.Server, so the services a server really carries (the generated add_*Servicer_to_server
helpers name them) are known without a second list kept by hand; then enable() adds the health
and reflection services' names and serves reflection on the same server. Same port, same
credentials: where the port needs mTLS, so does reflection.

    grpcurl -plaintext 127.0.0.1:50051 list
    grpcurl -plaintext 127.0.0.1:50051 describe specmesh.v1.Gateway.Generate
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

REFLECTION_SERVICE = reflection.SERVICE_NAME  # grpc.reflection.v1alpha.ServerReflection
HEALTH_SERVICE = health.SERVICE_NAME  # grpc.health.v1.Health


class ServiceRecorder:
    """A grpc.Server stand-in for registration: forwards every call, remembers service names."""

    def __init__(self, server: grpc.Server):
        self._server = server
        self.names: list[str] = []

    def _note(self, name: str | None) -> None:
        if name and name not in self.names:
            self.names.append(name)

    def add_generic_rpc_handlers(self, handlers) -> None:
        for h in handlers:
            service_name = getattr(h, "service_name", None)  # grpc.method_handlers_generic_handler has one
            self._note(service_name() if callable(service_name) else None)
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers) -> None:
        self._note(service_name)
        self._server.add_registered_method_handlers(service_name, method_handlers)

    def __getattr__(self, name: str):
        return getattr(self._server, name)


def enable(server: grpc.Server, services: list[str]) -> tuple[str, ...]:
    """Serve reflection for `services` plus health and reflection itself; returns the full list."""
    names = tuple(dict.fromkeys([*services, HEALTH_SERVICE, REFLECTION_SERVICE]))
    reflection.enable_server_reflection(names, server)
    return names
