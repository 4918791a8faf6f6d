"""One worker process's place in the mesh: registration (with a registry) and drain on SIGTERM.

Drain (SIGTERM/SIGINT, before the gRPC server stops):
  1. health NOT_SERVING; with a registry, the record is republished with draining=true, so every
     coordinator stops routing new work here within one poll interval;
  2. begin_drain(): the servicer refuses new sequences (a target's Prefill answers UNAVAILABLE,
     which the coordinator retries on another target);
  3. wait until is_idle() (a target: no live sequence still in use), at least two poll intervals
     with a registry, at most drain_timeout_s;
  4. deregister, then the normal graceful server stop.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable

from specmesh.registry.heartbeat import Registration
from specmesh.registry.records import WorkerRecord, new_worker_id
from specmesh.registry.store import Registry
from specmesh.rpc.server import Service

log = logging.getLogger(__name__)

WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]")


def advertise_address(listen: str, port: int, advertise_host: str | None = None) -> str:
    """The host:port other services should dial for a server listening on `listen` (bound `port`)."""
    host = listen.rsplit(":", 1)[0]
    if advertise_host == "ip":
        host = socket.gethostbyname(socket.gethostname())
    elif advertise_host:
        host = advertise_host
    elif host in WILDCARD_HOSTS:
        host = socket.gethostname()
    return f"{host}:{port}"


class WorkerLifecycle:
    def __init__(self, rcfg, tier: str, *, model: str = "", fingerprint: str = "", methods=(), capacity: dict | None = None,
                 load_fn: Callable[[], dict] | None = None, begin_drain: Callable[[], None] | None = None,
                 is_idle: Callable[[], bool] | None = None, drain_timeout_s: float = 0.0):
        self.rcfg, self.tier = rcfg, tier
        self.model, self.fingerprint = model, fingerprint
        self.methods, self.capacity = tuple(methods), dict(capacity or {})
        self.load_fn, self.begin_drain = load_fn, begin_drain
        self.is_idle = is_idle or (lambda: True)
        self.drain_timeout_s = drain_timeout_s
        self.registration: Registration | None = None
        self.address: str | None = None
        self._drained = threading.Event()
        self._lock = threading.Lock()

    def attach(self, service: Service) -> "WorkerLifecycle":
        """Call after service.start(): register (with a registry) and hook drain into stop()."""
        self.address = advertise_address(service.listen, service.port, self.rcfg.advertise_host)
        service.lifecycle = self
        if self.rcfg.url:
            record = WorkerRecord(new_worker_id(self.tier), self.tier, self.address, self.model, self.fingerprint,
                                  self.methods, self.capacity)
            self.registration = Registration(Registry.from_config(self.rcfg), record, self.load_fn,
                                             self.rcfg.heartbeat_interval_s).start()
        return self

    def drain(self) -> None:
        with self._lock:
            if self._drained.is_set():
                return
            self._drained.set()
        started = time.monotonic()
        min_wait = 2 * self.rcfg.poll_interval_s if self.registration else 0.0
        deadline = started + max(self.drain_timeout_s, min_wait)
        if self.registration:
            self.registration.set_draining()
        if self.begin_drain:
            self.begin_drain()
        log.info("%s draining (at most %.1fs)", self.tier, deadline - started)
        while time.monotonic() < deadline:
            if time.monotonic() - started >= min_wait and self._idle():
                break
            time.sleep(0.1)
        log.info("%s drained in %.1fs", self.tier, time.monotonic() - started)
        if self.registration:
            self.registration.stop()

    def deregister(self) -> None:
        """Remove the record now (no drain): for processes that drain by other means."""
        if self.registration:
            self.registration.stop()
            self.registration = None

    def _idle(self) -> bool:
        try:
            return bool(self.is_idle())
        except Exception:  # noqa: BLE001
            return True


class DrainingService(Service):
    """A Service whose stop() drains first (WorkerLifecycle.attach sets `lifecycle`)."""

    lifecycle: WorkerLifecycle | None = None

    def stop(self, *args, **kwargs) -> None:
        if self.lifecycle is not None:
            self.set_serving(False)
            self.lifecycle.drain()
        super().stop(*args, **kwargs)
