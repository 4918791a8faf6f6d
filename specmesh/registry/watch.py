"""Coordinator side: poll the registry and hand each tier's live records to a pool.

Polling (every registry.poll_interval_s) rather than keyspace notifications: it needs no Redis
configuration, and a missed event can never leave a stale member. When Redis is unreachable the
last known membership is kept (workers that are up keep serving) and the outage is logged once.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from specmesh.registry.records import WorkerRecord
from specmesh.registry.store import Registry, RegistryError

log = logging.getLogger(__name__)


class RegistryWatcher:
    def __init__(self, registry: Registry, subscribers: dict[str, Callable[[list[WorkerRecord]], None]],
                 poll_interval_s: float = 0.5):
        self.registry = registry
        self.subscribers = subscribers  # tier -> on_change(records)
        self.poll_interval_s = poll_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False
        self.syncs = 0

    def sync(self) -> bool:
        """Read every subscribed tier once and deliver it. False when the registry is unreachable."""
        try:
            snapshot = {tier: self.registry.list(tier) for tier in self.subscribers}
        except RegistryError as exc:
            if not self._failing:
                log.warning("registry unreachable, keeping the last known workers: %s", exc)
            self._failing = True
            return False
        if self._failing:
            log.info("registry reachable again")
        self._failing = False
        for tier, records in snapshot.items():
            self.subscribers[tier](records)
        self.syncs += 1
        return True

    def start(self) -> "RegistryWatcher":
        self.sync()
        self._thread = threading.Thread(target=self._loop, name="registry-watch", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_interval_s):
            try:
                self.sync()
            except Exception:  # noqa: BLE001 - a pool bug must not kill discovery
                log.exception("registry sync failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_interval_s + 2)
