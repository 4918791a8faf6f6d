"""The draft worker's per-sequence state (draft KV, feature windows), keyed by seq_id: an LRU
bounded in sequences and, optionally, in tokens; released sequences stay released."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable


class SequenceLru:
    """Per-sequence drafter state keyed by seq_id, least recently stored evicted past max_items
    (and, with max_tokens, past that many tokens in all, as size(item) counts them: a stream of
    long, never-released sequences cannot grow the draft worker's memory without bound).
    take() removes the entry (the model thread owns it while drafting); put() stores it back.
    release() drops it for good: a seq_id names one request, so the state of a released one that
    is stored back later (it was being drafted for, or its last Propose ran after the Release) is
    dropped too, as long as the release is among the last RELEASED_KEPT."""

    RELEASED_KEPT = 4096

    def __init__(self, max_items: int, max_tokens: int = 0, size: Callable = lambda item: 0):
        self._items: OrderedDict = OrderedDict()
        self._released: OrderedDict = OrderedDict()  # seq_id -> None, the most recent releases
        self._max, self._max_tokens, self._size = max_items, max_tokens, size
        self._lock = threading.Lock()

    def take(self, seq_id: str):
        with self._lock:
            return self._items.pop(seq_id, None)

    def release(self, seq_id: str) -> None:
        with self._lock:
            self._items.pop(seq_id, None)
            self._released[seq_id] = None
            if len(self._released) > self.RELEASED_KEPT:
                self._released.popitem(last=False)

    def put(self, seq_id: str, item) -> None:
        with self._lock:
            if seq_id in self._released:
                return
            self._items[seq_id] = item
            while len(self._items) > self._max:
                self._items.popitem(last=False)
            if self._max_tokens:
                total = sum(self._size(x) for x in self._items.values())
                while total > self._max_tokens and len(self._items) > 1:  # the newest stays
                    total -= self._size(self._items.popitem(last=False)[1])

    def __getitem__(self, seq_id: str):  # a look without taking (tests, introspection)
        with self._lock:
            return self._items[seq_id]

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._items

    def __len__(self) -> int:
        return len(self._items)

    def tokens(self) -> int:
        """What size() counts over the entries held now (KV slots, for the model drafter)."""
        with self._lock:
            return sum(self._size(x) for x in self._items.values())
