"""Server start-up shared by the four services: interceptors, health, reflection, TLS, metrics,
shutdown.

Every server runs the telemetry interceptor (span, request context, metrics, access log) around
the one typed-error mapping (specmesh.rpc.errors). Channels between services carry the trace
context (client interceptor) and use mTLS once `configure_mesh_tls` was given the mesh files.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specmesh.rpc import reflection
from specmesh.rpc.client_tls import read_pem
from specmesh.telemetry import metrics, tracing
from specmesh.telemetry.interceptors import ClientInterceptor, ServerInterceptor

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # a peer that is not up yet (a big target still loading) is retried every <= 2 s, not on gRPC's
    # default backoff (x1.6 up to 120 s), which left a worker that came up after a minute unused
    # for as long again
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # a peer that stops answering (SIGSTOP, a hung host, a cut link) is found within ~15 s: its calls
    # fail UNAVAILABLE (the coordinator then fails over, a client retries) instead of waiting out
    # their deadline. Servers accept these pings (SERVER_OPTIONS) and ping their clients alike.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.ping_timeout_ms", 5_000),  # gRPC core waits this long for any ping's ack (default 60 s)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = [  # what a server needs beyond CHANNEL_OPTIONS: tolerate the clients' keepalive pings
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]
ROLES = {"Gateway": "gateway", "Coordinator": "coordinator", "DraftWorker": "draft_worker",
         "TargetWorker": "target_worker", "Admin": "gateway"}
MESH = "mesh"  # Service(credentials=MESH): mTLS when configured, else plaintext


@dataclass(frozen=True)
class MeshTls:
    channel: grpc.ChannelCredentials
    server: grpc.ServerCredentials
    server_name: str | None


_mesh_tls: MeshTls | None = None


def configure_mesh_tls(mesh_cfg) -> None:
    """mesh_cfg: specmesh.config.MeshTlsConfig. All three files: every internal server requires a
    client certificate signed by ca_file, every internal channel presents cert_file. None: off."""
    global _mesh_tls
    if mesh_cfg is None or mesh_cfg.cert_file is None:
        _mesh_tls = None
        return
    key, cert, ca = read_pem(mesh_cfg.key_file), read_pem(mesh_cfg.cert_file), read_pem(mesh_cfg.ca_file)
    _mesh_tls = MeshTls(
        channel=grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert),
        server=grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True),
        server_name=mesh_cfg.server_name)


def public_server_credentials(public_cfg) -> grpc.ServerCredentials | None:
    """public_cfg: specmesh.config.PublicTlsConfig; None = plaintext."""
    if public_cfg is None or public_cfg.cert_file is None:
        return None
    ca = read_pem(public_cfg.client_ca_file)  # None: no client certificates required
    return grpc.ssl_server_credentials([(read_pem(public_cfg.key_file), read_pem(public_cfg.cert_file))],
                                       root_certificates=ca, require_client_auth=ca is not None)


# several replicas behind one channel: round-robin over the ready ones; a call refused UNAVAILABLE
# before any answer (a replica just killed, or full) is tried again, on the next replica
_REPLICAS_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}], "methodConfig": [{
    "name": [{}], "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.2s", "maxBackoff": "1s",
                                  "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE"]}}]})


def replicas_target(value: str) -> tuple[str, list]:
    """(gRPC target, extra channel options) for a config value naming one service's replicas:
    "host:port" (one), "ip:port,ip:port" (several) or "dns:///name:port" (all its addresses)."""
    if "," in value:
        addrs = [a.strip().replace("localhost:", "127.0.0.1:") for a in value.split(",")]
        return "ipv4:" + ",".join(addrs), [("grpc.service_config", _REPLICAS_CONFIG),
                                           ("grpc.default_authority", addrs[0])]
    if value.startswith("dns:///"):
        return value, [("grpc.service_config", _REPLICAS_CONFIG)]
    return value, []


def make_channel(address: str, credentials: grpc.ChannelCredentials | None = None,
                 server_name: str | None = None) -> grpc.Channel:
    """A channel to another service (see replicas_target for several replicas): mesh mTLS when
    configured (or the credentials given), and the client interceptor that forwards trace context
    and request facts."""
    address, extra = replicas_target(address)
    options = list(CHANNEL_OPTIONS) + extra
    if credentials is None and _mesh_tls is not None:
        credentials, server_name = _mesh_tls.channel, server_name or _mesh_tls.server_name
    if server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    channel = grpc.secure_channel(address, credentials, options=options) if credentials is not None \
        else grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(channel, ClientInterceptor())


def service_options(cfg, role: str) -> dict:
    """Service(...) keyword arguments for `role` from the MeshConfig (also turns mesh mTLS on)."""
    configure_mesh_tls(cfg.tls.mesh)
    if cfg.logging.format != "json":
        from specmesh.logs import setup_logging

        setup_logging(role, cfg.runtime.log_level, cfg.logging.format)
    bp = getattr(cfg.backpressure, role)
    opts = dict(metrics_port=getattr(cfg.metrics, f"{role}_port"), metrics_host=cfg.metrics.host,
                grace_s=cfg.shutdown.grace_s, min_workers=bp.max_inflight + bp.max_queue + 8)
    if role == "gateway":
        opts.update(credentials=public_server_credentials(cfg.tls.public), public=True,
                    max_message_bytes=cfg.gateway.max_message_bytes)
    return opts


class Service:
    """A started gRPC server with its health and reflection servicers; stop() drains with a grace
    period. `services`: the full names it serves (what reflection lists).

    credentials: MESH (default: mesh mTLS if configured), None (plaintext) or ServerCredentials.
    public: the interceptor trusts no x-specmesh-* metadata from callers (the gateway's port).
    ready_on_start=False: NOT_SERVING until set_serving(True) (the gateway's probe decides).
    max_message_bytes: the largest request accepted (RESOURCE_EXHAUSTED beyond, answered by gRPC).
    RPCs at once are bounded too: four times the handler threads, beyond that RESOURCE_EXHAUSTED (gRPC),
    so a flood of calls never queues without limit."""

    def __init__(self, name: str, listen: str, register: Callable[[grpc.Server], None], max_workers: int, *,
                 credentials=MESH, public: bool = False, metrics_port: int = 0, metrics_host: str = "127.0.0.1",
                 grace_s: float = 10.0, min_workers: int = 0, ready_on_start: bool = True,
                 max_message_bytes: int = MAX_MESSAGE_BYTES):
        self.name = name
        self.role = ROLES.get(name.rsplit(".", 1)[-1], name)
        tracing.setup_tracing(self.role)
        self.draining = False  # health stays NOT_SERVING
        self.refusing = False  # new RPCs get UNAVAILABLE (set by stop())
        self.interceptor = ServerInterceptor(self.role, public=public, refusing=lambda: self.refusing)
        threads = max(max_workers, min_workers)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix=self.role),
            interceptors=[self.interceptor],
            # no SO_REUSEPORT: a second server on a taken port must fail, not share it silently
            options=[o for o in CHANNEL_OPTIONS if o[0] != "grpc.max_receive_message_length"]
            + SERVER_OPTIONS + [("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", max_message_bytes)],
            maximum_concurrent_rpcs=4 * threads,
        )
        recorder = reflection.ServiceRecorder(self.server)
        register(recorder)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # reflection (grpcurl list / describe) on the same port: it inherits the port's TLS / mTLS
        self.services = reflection.enable(self.server, recorder.names)
        if credentials == MESH:
            credentials = _mesh_tls.server if _mesh_tls is not None else None
        self.tls = credentials is not None
        self.port = self.server.add_secure_port(listen, credentials) if credentials is not None \
            else self.server.add_insecure_port(listen)
        if self.port == 0:
            raise RuntimeError(f"{name}: cannot listen on {listen}")
        self.listen = listen.rsplit(":", 1)[0] + f":{self.port}"
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self.grace_s, self.ready_on_start = grace_s, ready_on_start
        self._stopped = threading.Event()

    def start(self) -> "Service":
        self.server.start()
        self.set_serving(self.ready_on_start)
        self.metrics_port = metrics.serve(self.metrics_host, self.metrics_port, self.role)
        log.info("%s listening on %s%s", self.name, self.listen, " (TLS)" if self.tls else "")
        return self

    def set_serving(self, serving: bool) -> None:
        serving = serving and not self.draining
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)
        self.health.set(self.name, status)

    def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING; new RPCs get UNAVAILABLE; in-flight ones finish within grace_s; then stop."""
        self.draining = True
        self.set_serving(False)
        self.refusing = True
        deadline = time.monotonic() + (self.grace_s if grace_s is None else grace_s)
        while self.interceptor.inflight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.server.stop(max(0.0, deadline - time.monotonic())).wait()
        self._stopped.set()

    def wait_for_signal(self, grace_s: float | None = None, on_stop: Callable[[], None] | None = None,
                        on_drain: Callable[[], None] | None = None) -> None:
        """Block until SIGTERM/SIGINT; then NOT_SERVING, refuse new RPCs, let in-flight ones finish
        within the grace period, run on_stop, flush traces, return (the process exits 0)."""
        got = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: got.set())
        while not got.wait(0.5) and not self._stopped.is_set():
            pass
        grace_s = self.grace_s if grace_s is None else grace_s
        log.info("%s draining (grace %.1fs)", self.name, grace_s)
        self.draining = True  # health: NOT_SERVING from now on
        if on_drain:
            on_drain()
        self.stop(grace_s)
        if on_stop:
            on_stop()
        tracing.shutdown_tracing()
        log.info("%s stopped", self.name)
