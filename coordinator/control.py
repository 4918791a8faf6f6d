"""The speculation hot switch: on/off, drafter and k overrides, read by every new round; and the
canary (share of requests that speculate, API keys it is limited to), read once per request. Pure.

`effective(method, k)` maps a request's own (method, k) to what the next round uses:
switched off -> ("off", 0); a request that asked for "off" stays off; otherwise the overrides
(if set) replace the request's method and k. `arm(...)` puts a new request in the canary's
`spec` or `control` arm (specmesh/core/canary.py); the coordinator runs `control` requests off.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from specmesh.config import DRAFTERS
from specmesh.core.canary import Canary, check_share
from specmesh.errors import InvalidArgument


@dataclass(frozen=True)
class SpeculationState:
    enabled: bool = True
    method: str | None = None  # drafter override; None = each request's own
    k: int | None = None  # k override; None = each request's own
    version: int = 0
    canary: Canary = field(default_factory=Canary)


class SpeculationControl:
    def __init__(self, max_k: int, on_change=None, canary: Canary | None = None):
        self.max_k = max_k
        self.configured = canary or Canary()  # what `reset` and a restart come back to
        self._state = SpeculationState(canary=self.configured)
        self._lock = threading.Lock()
        self._on_change = on_change  # called with the new state (metrics)

    @property
    def state(self) -> SpeculationState:
        return self._state

    def set(self, enabled: bool | None = None, method: str | None = None, k: int | None = None,
            reset: bool = False, share: float | None = None, keys: tuple[str, ...] | None = None
            ) -> SpeculationState:
        """method "" clears the drafter override, k -1 clears the k override, keys () = every key;
        None leaves as is. Setting share or keys clears a guard trip."""
        if method is not None and method != "" and method not in DRAFTERS:
            raise InvalidArgument("method", f"unknown drafter {method!r} (known: {', '.join(DRAFTERS)})")
        if k is not None and k != -1 and not 0 <= k <= self.max_k:
            raise InvalidArgument("num_speculative_tokens", f"must be in [0, {self.max_k}] (or -1 to clear)")
        if share is not None:
            share = check_share(share)
        with self._lock:
            s = SpeculationState(version=self._state.version, canary=self.configured) if reset else self._state
            if enabled is not None:
                s = replace(s, enabled=enabled)
            if method is not None:
                s = replace(s, method=method or None)
            if k is not None:
                s = replace(s, k=None if k == -1 else k)
            if share is not None or keys is not None:
                c = s.canary
                s = replace(s, canary=Canary(c.share if share is None else share,
                                             c.keys if keys is None else tuple(keys)))
            self._state = s = replace(s, version=s.version + 1)
        return self._notify(s)

    def trip(self, reason: str, seen: Canary | None = None) -> SpeculationState | None:
        """The canary guard: share -> 0 (every new request in `control`), with the reason kept.
        seen: the canary the guard judged; if it has changed since, nothing is done (None)."""
        with self._lock:
            s = self._state
            if seen is not None and s.canary != seen:
                return None
            self._state = s = replace(s, canary=replace(s.canary, share=0.0, tripped=reason),
                                      version=s.version + 1)
        return self._notify(s)

    def _notify(self, s: SpeculationState) -> SpeculationState:
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

    def arm(self, request_id: str, key_name: str = "", speculates: bool = True) -> str:
        return self._state.canary.arm(request_id, key_name, speculates)
