"""Server start-up shared by the four services: interceptor, health, clean shutdown."""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specmesh.rpc.errors import ErrorInterceptor

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def make_channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


class Service:
    """A started gRPC server with its health servicer; stop() drains with a grace period."""

    def __init__(self, name: str, listen: str, register: Callable[[grpc.Server], None], max_workers: int):
        self.name = name
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name),
            interceptors=[ErrorInterceptor()],
            options=CHANNEL_OPTIONS,
        )
        register(self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(listen)
        if self.port == 0:
            raise RuntimeError(f"{name}: cannot listen on {listen}")
        self.listen = listen.rsplit(":", 1)[0] + f":{self.port}"
        self._stopped = threading.Event()

    def start(self) -> "Service":
        self.server.start()
        self.set_serving(True)
        log.info("%s listening on %s", self.name, self.listen)
        return self

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)
        self.health.set(self.name, status)

    def stop(self, grace_s: float = 10.0) -> None:
        self.set_serving(False)
        self.server.stop(grace_s).wait()
        self._stopped.set()

    def wait_for_signal(self, grace_s: float = 10.0, on_stop: Callable[[], None] | None = None) -> None:
        """Block until SIGTERM/SIGINT, then stop taking work, drain, run on_stop, return."""
        got = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: got.set())
        while not got.wait(0.5) and not self._stopped.is_set():
            pass
        log.info("%s stopping (grace %.1fs)", self.name, grace_s)
        self.stop(grace_s)
        if on_stop:
            on_stop()
