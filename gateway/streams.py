"""Concurrent requests per client connection and per API key (gateway.max_streams_per_connection,
gateway.max_streams_per_key). One more than allowed is answered RESOURCE_EXHAUSTED at once: one
client cannot take every admission slot of the gateway, and a key cannot either over several
connections. A connection is its peer address (ip:port of the client's TCP connection)."""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

from specmesh.errors import ResourceExhausted


class StreamLimits:
    def __init__(self, per_connection: int, per_key: int):
        self.per_connection, self.per_key = per_connection, per_key  # 0: no limit
        self._by_peer: Counter = Counter()
        self._by_key: Counter = Counter()
        self._lock = threading.Lock()

    def _take(self, peer: str, key: str | None) -> None:
        with self._lock:
            if self.per_connection and self._by_peer[peer] >= self.per_connection:
                raise ResourceExhausted(f"at most {self.per_connection} concurrent requests per connection")
            if key and self.per_key and self._by_key[key] >= self.per_key:
                raise ResourceExhausted(f"at most {self.per_key} concurrent requests per API key")
            self._by_peer[peer] += 1
            if key:
                self._by_key[key] += 1

    def _give(self, peer: str, key: str | None) -> None:
        with self._lock:
            for counter, name in ((self._by_peer, peer), (self._by_key, key)):
                if name:
                    counter[name] -= 1
                    if counter[name] <= 0:
                        del counter[name]

    @contextmanager
    def slot(self, peer: str, key: str | None) -> Iterator[None]:
        """key: the API key's id (its hash), None when auth is off."""
        self._take(peer, key)
        try:
            yield
        finally:
            self._give(peer, key)

    def held(self) -> tuple[int, int]:
        """(connections, keys) with a request in flight (0, 0 once everything finished)."""
        with self._lock:
            return len(self._by_peer), len(self._by_key)
