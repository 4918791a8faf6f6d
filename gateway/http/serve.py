"""HttpFront: the OpenAI-compatible app served by uvicorn on its own thread and event loop.

The socket is bound here, before anything else starts, so a taken port fails the gateway's
start with a clear OSError. TLS: the same files as the gRPC public port (tls.public; with
client_ca_file, client certificates are required). Shutdown: drain() makes new requests 503
at once, stop() lets in-flight ones finish within the grace period, then closes.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from gateway.http.app import FrontState, build_app

log = logging.getLogger(__name__)


def bind(listen: str) -> socket.socket:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def _tls_options(public_tls) -> dict:
    if public_tls is None or public_tls.cert_file is None:
        return {}
    opts = {"ssl_certfile": public_tls.cert_file, "ssl_keyfile": public_tls.key_file}
    if public_tls.client_ca_file:
        opts.update(ssl_ca_certs=public_tls.client_ca_file, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return opts


class HttpFront:
    def __init__(self, cfg, core, listen: str | None = None):
        """cfg: the MeshConfig; core: the gateway's GatewayCore (the gRPC servicer is one)."""
        listen = listen or cfg.http.listen
        if not listen:
            raise ValueError("http.listen is not set")
        bp = cfg.backpressure.gateway
        # as the gRPC server: a thread for every request admitted or queued, and a few more
        self.pool = ThreadPoolExecutor(bp.max_inflight + bp.max_queue + 8, thread_name_prefix="gateway-http")
        self.state = FrontState()
        self.sock = bind(listen)
        host, port = listen.rpartition(":")[0], self.sock.getsockname()[1]
        self.tls = cfg.tls.public.cert_file is not None
        self.address = f"{host}:{port}"
        self.url = f"{'https' if self.tls else 'http'}://{self.address}/v1"
        config = uvicorn.Config(build_app(core, cfg, self.pool, self.state), http="h11", loop="asyncio",
                                ws="none", lifespan="off", interface="asgi3", log_config=None, access_log=False,
                                timeout_graceful_shutdown=max(1, int(cfg.shutdown.grace_s)),
                                **_tls_options(cfg.tls.public))
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="gateway-http", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve(sockets=[self.sock]))
        except BaseException as exc:  # noqa: BLE001 - reported by start() / logged
            self._error = exc
            log.error("HTTP front stopped: %s", exc)

    def start(self, timeout_s: float = 30.0) -> "HttpFront":
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.sock.close()
                raise RuntimeError(f"HTTP front did not start on {self.address}: {self._error}")
            time.sleep(0.01)
        log.info("OpenAI-compatible HTTP front listening on %s", self.url)
        return self

    def drain(self) -> None:
        """New requests get 503 from now on; those in flight go on."""
        self.state.draining = True

    def stop(self, grace_s: float | None = None) -> None:
        self.drain()
        if grace_s is not None:
            self.server.config.timeout_graceful_shutdown = max(1, int(grace_s))
        self.server.should_exit = True
        self._thread.join((grace_s if grace_s is not None else self.server.config.timeout_graceful_shutdown) + 5)
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.sock.close()
