"""One tier's workers as the coordinator sees them: from a static list or the registry's records."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Member:
    address: str
    client: Any
    record: Any = None  # the worker's latest WorkerRecord (registry mode), else None
    inflight: int = 0  # this coordinator's sequences (target) / rounds (draft) on it now
    down_until: float = 0.0
    removed: bool = False

    @property
    def draining(self) -> bool:
        return bool(self.record is not None and self.record.draining)

    def reported(self, key: str) -> int:
        return int(self.record.load.get(key, 0)) if self.record is not None else 0


class Members:
    """One tier's workers by address; update() replaces them with the registry's live records."""

    def __init__(self, addresses, make_client: Callable[[str], Any], tier: str):
        self.make_client, self.tier = make_client, tier
        self.lock = threading.Lock()
        self.by_addr: dict[str, Member] = {a: Member(a, make_client(a)) for a in dict.fromkeys(addresses)}
        self._rr = itertools.count()

    def update(self, records) -> None:
        # one record per address: a restarted worker's fresh record wins over its old draining one
        fresh = {r.address: r for r in sorted(records, key=lambda r: (not r.draining, r.started_at))}
        with self.lock:
            for addr in [a for a in self.by_addr if a not in fresh]:
                member = self.by_addr.pop(addr)
                member.removed = True
                log.info("%s worker %s left", self.tier, addr)
                self._maybe_close(member)
            for addr, rec in fresh.items():
                if addr not in self.by_addr:
                    self.by_addr[addr] = Member(addr, self.make_client(addr))
                    log.info("%s worker %s joined (%s)", self.tier, addr, rec.worker_id)
                self.by_addr[addr].record = rec

    def snapshot(self) -> list[Member]:
        with self.lock:
            return list(self.by_addr.values())

    def candidates(self, exclude=(), ok: Callable[[Member], bool] = lambda m: True) -> list[Member]:
        """Usable members (call with the lock held), rotated so ties go round-robin."""
        now = time.monotonic()
        usable = [m for m in self.by_addr.values()
                  if m.address not in exclude and not m.draining and m.down_until <= now and ok(m)]
        if not usable:
            return usable
        r = next(self._rr) % len(usable)
        return usable[r:] + usable[:r]

    def any_usable(self, ok: Callable[[Member], bool] = lambda m: True) -> bool:
        """Whether candidates(ok=ok) would name anyone now (takes the lock; rotates nothing)."""
        now = time.monotonic()
        with self.lock:
            return any(not m.draining and m.down_until <= now and ok(m) for m in self.by_addr.values())

    def mark_down(self, member: Member, seconds: float) -> None:
        with self.lock:
            member.down_until = time.monotonic() + seconds

    def done(self, member: Member) -> None:
        with self.lock:
            member.inflight = max(0, member.inflight - 1)
            self._maybe_close(member)

    @staticmethod
    def _maybe_close(member: Member) -> None:
        if member.removed and member.inflight == 0:
            member.client.close()
