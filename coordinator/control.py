"""The speculation hot switch: on/off, drafter and k overrides, read by every new round. Pure.

`effective(method, k)` maps a request's own (method, k) to what the next round uses:
switched off -> ("off", 0); a request that asked for "off" stays off; otherwise the overrides
(if set) replace the request's method and k.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from specmesh.config import DRAFTERS
from specmesh.errors import InvalidArgument


@dataclass(frozen=True)
class SpeculationState:
    enabled: bool = True
    method: str | None = None  # drafter override; None = each request's own
    k: int | None = None  # k override; None = each request's own
    version: int = 0


class SpeculationControl:
    def __init__(self, max_k: int, on_change=None):
        self.max_k = max_k
        self._state = SpeculationState()
        self._lock = threading.Lock()
        self._on_change = on_change  # called with the new state (metrics)

    @property
    def state(self) -> SpeculationState:
        return self._state

    def set(self, enabled: bool | None = None, method: str | None = None, k: int | None = None,
            reset: bool = False) -> SpeculationState:
        """method "" clears the drafter override, k -1 clears the k override; None leaves as is."""
        if method is not None and method != "" and method not in DRAFTERS:
            raise InvalidArgument("method", f"unknown drafter {method!r} (known: {', '.join(DRAFTERS)})")
        if k is not None and k != -1 and not 0 <= k <= self.max_k:
            raise InvalidArgument("num_speculative_tokens", f"must be in [0, {self.max_k}] (or -1 to clear)")
        with self._lock:
            s = SpeculationState(version=self._state.version) if reset else self._state
            if enabled is not None:
                s = replace(s, enabled=enabled)
            if method is not None:
                s = replace(s, method=method or None)
            if k is not None:
                s = replace(s, k=None if k == -1 else k)
            self._state = s = replace(s, version=s.version + 1)
        if self._on_change is not None:
            self._on_change(s)
        return s

    def effective(self, method: str, k: int) -> tuple[str, int]:
        s = self._state
        if not s.enabled or method == "off":
            return "off", 0
        method = s.method or method
        k = s.k if s.k is not None else k
        return (method, k) if k > 0 else ("off", 0)
