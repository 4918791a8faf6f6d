"""The coordinator's side of the speculation canary: per-arm numbers read from its own
Prometheus metrics (what /metrics exports), the window since the canary last changed (for
`specmesh admin canary`), and the guard thread (coordinator.canary.guard_margin).

The arm choice and the guard's arithmetic are pure (specmesh/core/canary*.py); this module only
reads metric families and keeps snapshots.
"""

from __future__ import annotations

import logging
import threading
import time

from specmesh.core.canary import ARMS, Canary
from specmesh.core.canary_stats import ArmStats, guard_verdict
from specmesh.telemetry import metrics

log = logging.getLogger(__name__)


def _histograms(family) -> dict[str, tuple]:
    """arm -> ((le, cumulative count), ...) from a labelled prometheus_client Histogram."""
    out: dict[str, list] = {}
    for metric in family.collect():
        for s in metric.samples:
            if s.name.endswith("_bucket"):
                out.setdefault(s.labels["arm"], []).append((float(s.labels["le"]), s.value))
    return {arm: tuple(sorted(buckets)) for arm, buckets in out.items()}


def read_arms() -> dict[str, ArmStats]:
    """Every arm's totals since this process started."""
    tpot, e2e = _histograms(metrics.TPOT), _histograms(metrics.E2E)
    arms = {arm: ArmStats(tpot=tpot.get(arm, ()), e2e=e2e.get(arm, ())) for arm in ARMS}
    for metric in metrics.REQUESTS.collect():
        for s in metric.samples:
            if s.name.endswith("_total") and s.labels["arm"] in arms:
                arms[s.labels["arm"]].codes[s.labels["code"]] = s.value
    return arms


class CanaryBook:
    """Snapshots of the arms taken whenever an admin changes the canary (share, keys): report()
    gives the numbers since then (at first: since start). A guard trip starts no new window, so
    the numbers that tripped it stay on show. Hook `changed` into SpeculationControl's on_change."""

    def __init__(self, canary: Canary, read=read_arms, clock=time.monotonic):
        self.read, self.clock = read, clock
        self._lock = threading.Lock()
        self._canary = (canary.share, canary.keys)
        self._baseline: dict[str, ArmStats] = {}
        self._since = self._started = clock()

    def changed(self, state) -> None:
        c = state.canary
        with self._lock:
            if (c.share, c.keys) == self._canary:
                return
            self._canary = (c.share, c.keys)
            if not c.tripped:
                self._baseline, self._since = self.read(), self.clock()

    def report(self, since_start: bool = False) -> tuple[dict[str, ArmStats], float]:
        now = self.read()
        with self._lock:
            base, since = ({}, self._started) if since_start else (self._baseline, self._since)
        return {arm: stats.since(base.get(arm)) for arm, stats in now.items()}, self.clock() - since


class CanaryGuard:
    """Every interval_s: compare the arms' TPOT p99 over the window since the last verdict (or
    since the canary changed); when spec's exceeds control's by more than `margin`, trip the
    control (share -> 0), log a warning and count specmesh_canary_guard_trips_total."""

    def __init__(self, control, margin: float, min_requests: int, interval_s: float, read=read_arms):
        self.control, self.margin, self.min_requests, self.interval_s = control, margin, min_requests, interval_s
        self.read = read
        self._canary: Canary | None = None
        self._baseline: dict[str, ArmStats] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self):
        """One look; returns the Verdict (None when there is nothing to judge)."""
        state = self.control.state
        canary, now = state.canary, self.read()
        if self._canary != canary:  # changed (or first look): a new window starts now
            self._canary, self._baseline = canary, now
            return None
        if canary.share <= 0.0:
            return None
        spec = now["spec"].since(self._baseline.get("spec"))
        control = now["control"].since(self._baseline.get("control"))
        verdict = guard_verdict(spec.tpot, control.tpot, self.margin, self.min_requests)
        if not verdict.ready:
            return verdict
        self._baseline = now  # the next verdict looks at new requests only
        if not verdict.trip:
            log.info("canary guard: %s", verdict.reason, extra={"fields": {"event": "canary_guard_check"}})
        elif self.control.trip(verdict.reason, seen=canary) is not None:
            metrics.CANARY_GUARD_TRIPS.inc()
            log.warning("canary guard tripped: %s; share -> 0", verdict.reason,
                        extra={"fields": {"event": "canary_guard_trip", "reason": verdict.reason,
                                          "spec_tpot_p99_s": verdict.spec_p99,
                                          "control_tpot_p99_s": verdict.control_p99, "margin": self.margin}})
        return verdict

    def start(self) -> "CanaryGuard":
        self._thread = threading.Thread(target=self._loop, name="canary-guard", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the guard must never take the coordinator down
                log.exception("canary guard check failed")

    def stop(self) -> None:
        self._stop.set()
