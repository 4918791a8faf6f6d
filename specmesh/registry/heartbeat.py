"""Worker side: publish the record now, refresh it (with the current load) every interval.

A worker that stops heartbeating (killed, hung, partitioned) disappears when its key expires
(registry.ttl_s); one that drains (SIGTERM) publishes draining=true at once, so coordinators
stop sending it new work at their next poll, and removes its key when it exits.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from specmesh.registry.records import WorkerRecord
from specmesh.registry.store import Registry, RegistryError

log = logging.getLogger(__name__)


class Registration:
    def __init__(self, registry: Registry, record: WorkerRecord, load_fn: Callable[[], dict] | None = None,
                 interval_s: float = 1.0):
        self.registry, self.record = registry, record
        self.load_fn = load_fn or (lambda: {})
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failing = False

    def start(self) -> "Registration":
        self.beat()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{self.record.tier}", daemon=True)
        self._thread.start()
        log.info("registered %s %s at %s in %s", self.record.tier, self.record.worker_id, self.record.address,
                 self.registry.url)
        return self

    def beat(self) -> bool:
        """Publish the record once (load refreshed). False (logged once per outage) when Redis is down."""
        with self._lock:
            try:
                self.record.load = dict(self.load_fn())
            except Exception as exc:  # noqa: BLE001 - a load probe must never stop the heartbeat
                log.warning("load probe failed: %s", exc)
            self.record.updated_at = time.time()
            try:
                self.registry.put(self.record)
            except RegistryError as exc:
                if not self._failing:
                    log.warning("heartbeat failed (will keep trying): %s", exc)
                self._failing = True
                return False
        if self._failing:
            log.info("heartbeat recovered")
        self._failing = False
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def set_draining(self) -> None:
        self.record.draining = True
        self.beat()

    def stop(self) -> None:
        """Stop heartbeating and remove the record (best effort: otherwise it expires)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval_s + 2)
        try:
            self.registry.remove(self.record.tier, self.record.worker_id)
        except RegistryError as exc:
            log.warning("could not deregister (the record expires by itself): %s", exc)
