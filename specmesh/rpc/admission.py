"""Backpressure: at most `max_inflight` requests at once, at most `max_queue` waiting for a slot.

A request beyond both is refused at once (Unavailable, retryable), so nothing ever queues
without bound; a waiting request gives up after `queue_timeout_s` or its own deadline. Pure
threading, no grpc: servicers call `with limiter.slot(deadline):` around the work.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

from specmesh.errors import DeadlineExceeded, Unavailable


class AdmissionLimiter:
    def __init__(self, name: str, max_inflight: int, max_queue: int, queue_timeout_s: float, on_reject=None):
        if max_inflight < 1 or max_queue < 0:
            raise ValueError("max_inflight must be >= 1 and max_queue >= 0")
        self.name = name
        self.on_reject = on_reject  # called (no arguments) for every refused request (metrics)
        self.max_inflight, self.max_queue, self.queue_timeout_s = max_inflight, max_queue, queue_timeout_s
        self._cond = threading.Condition()
        self._inflight = 0
        self._waiting = 0
        self.rejected = 0  # refused: queue full, or gave up waiting

    @classmethod
    def from_config(cls, name: str, cfg, on_reject=None) -> "AdmissionLimiter":
        """cfg: a specmesh.config.AdmissionConfig."""
        return cls(name, cfg.max_inflight, cfg.max_queue, cfg.queue_timeout_s, on_reject)

    def _rejected(self) -> None:
        self.rejected += 1
        if self.on_reject is not None:
            self.on_reject()

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def capacity(self) -> int:
        """Requests that can be inside the limiter at once (running + waiting)."""
        return self.max_inflight + self.max_queue

    def acquire(self, deadline: float | None = None) -> None:
        """Take a slot or raise Unavailable (queue full / wait too long) or DeadlineExceeded.

        deadline: time.monotonic() by which the caller's request must end."""
        with self._cond:
            if self._inflight < self.max_inflight and self._waiting == 0:
                self._inflight += 1
                return
            if self._waiting >= self.max_queue:
                self._rejected()
                raise Unavailable(f"{self.name} is overloaded: {self._inflight} in flight, "
                                  f"{self._waiting} queued; retry later")
            self._waiting += 1
            try:
                self._wait_for_slot(deadline)
            finally:
                self._waiting -= 1
            self._inflight += 1

    def _wait_for_slot(self, deadline: float | None) -> None:
        give_up = time.monotonic() + self.queue_timeout_s
        if deadline is not None:
            give_up = min(give_up, deadline)
        while self._inflight >= self.max_inflight:
            left = give_up - time.monotonic()
            if left <= 0:
                self._rejected()
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlineExceeded(f"deadline exceeded while queued at {self.name}")
                raise Unavailable(f"{self.name} is overloaded: no slot within {self.queue_timeout_s:g}s; "
                                  "retry later")
            self._cond.wait(left)

    def release(self) -> None:
        with self._cond:
            self._inflight -= 1
            self._cond.notify()

    @contextmanager
    def slot(self, deadline: float | None = None) -> Iterator[None]:
        self.acquire(deadline)
        try:
            yield
        finally:
            self.release()


def deadline_from(context) -> float | None:
    """A grpc ServicerContext's deadline as time.monotonic() (None: the client set none)."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining
