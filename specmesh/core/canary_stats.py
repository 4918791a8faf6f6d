"""Per-arm numbers of the speculation canary, and its guard. Pure: no grpc, no prometheus_client.

A histogram here is Prometheus's: a tuple of (upper bound `le`, cumulative count) pairs in
ascending order, the last bound +Inf. Quantiles are estimated as Prometheus's
histogram_quantile does: find the bucket holding rank q * count and interpolate linearly
inside it (from 0 for the first bucket); a rank in the +Inf bucket gives the highest finite bound.

The guard compares the two arms' TPOT p99 over a window: it trips when both arms have at least
`min_requests` samples and spec's p99 > control's p99 * (1 + margin).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

Histogram = tuple[tuple[float, float], ...]  # ((le, cumulative count), ...), +Inf last
OK_CODES = ("OK", "CANCELLED")  # a client that went away is not an error of the mesh


def count(h: Histogram) -> float:
    return h[-1][1] if h else 0.0


def subtract(now: Histogram, before: Histogram | None) -> Histogram:
    """now - before, bucket by bucket (the window between two snapshots); before None/() = now."""
    if not before:
        return tuple(now)
    _same_bounds(now, before)
    return tuple((le, max(0.0, c - b)) for (le, c), (_, b) in zip(now, before))


def merge(a: Histogram, b: Histogram) -> Histogram:
    """a + b (two coordinators' histograms of one metric)."""
    if not a:
        return tuple(b)
    if not b:
        return tuple(a)
    _same_bounds(a, b)
    return tuple((le, x + y) for (le, x), (_, y) in zip(a, b))


def _same_bounds(a: Histogram, b: Histogram) -> None:
    if [le for le, _ in a] != [le for le, _ in b]:
        raise ValueError("histograms with different bucket bounds")


def quantile(h: Histogram, q: float) -> float | None:
    """The q-quantile (0 <= q <= 1) of a histogram; None when it holds no sample."""
    total = count(h)
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le, cum in h:
        if cum >= rank and cum > below:
            if math.isinf(le):
                return lower  # the highest finite bound
            return lower + (le - lower) * (rank - below) / (cum - below)
        if not math.isinf(le):
            lower = le
        below = cum
    return lower


@dataclass
class ArmStats:
    """One arm's window: requests by final status code, TPOT and E2E histograms (seconds)."""

    codes: dict[str, float] = field(default_factory=dict)
    tpot: Histogram = ()
    e2e: Histogram = ()

    @property
    def requests(self) -> float:
        return sum(self.codes.values())

    @property
    def errors(self) -> float:
        return sum(n for code, n in self.codes.items() if code not in OK_CODES)

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    def merged(self, other: "ArmStats") -> "ArmStats":
        codes = dict(self.codes)
        for code, n in other.codes.items():
            codes[code] = codes.get(code, 0.0) + n
        return ArmStats(codes, merge(self.tpot, other.tpot), merge(self.e2e, other.e2e))

    def since(self, before: "ArmStats | None") -> "ArmStats":
        if before is None:
            return ArmStats(dict(self.codes), self.tpot, self.e2e)
        codes = {c: max(0.0, n - before.codes.get(c, 0.0)) for c, n in self.codes.items()}
        return ArmStats(codes, subtract(self.tpot, before.tpot), subtract(self.e2e, before.e2e))

    def summary(self) -> dict:
        return {"requests": int(self.requests), "errors": int(self.errors), "error_rate": self.error_rate,
                "tpot_p50_s": quantile(self.tpot, 0.5), "tpot_p99_s": quantile(self.tpot, 0.99),
                "e2e_p50_s": quantile(self.e2e, 0.5), "e2e_p99_s": quantile(self.e2e, 0.99),
                "tpot_samples": int(count(self.tpot))}


@dataclass(frozen=True)
class Verdict:
    trip: bool
    ready: bool  # both arms had enough samples to compare
    spec_p99: float | None = None
    control_p99: float | None = None
    reason: str = ""


def guard_verdict(spec_tpot: Histogram, control_tpot: Histogram, margin: float, min_requests: int) -> Verdict:
    """Trip when spec's TPOT p99 exceeds control's by more than `margin` (0.2 = 20 %)."""
    n_spec, n_control = count(spec_tpot), count(control_tpot)
    if n_spec < max(1, min_requests) or n_control < max(1, min_requests):
        return Verdict(False, False, reason=f"waiting for samples (spec {n_spec:.0f}, control {n_control:.0f}, "
                                             f"need {min_requests} each)")
    sp, cp = quantile(spec_tpot, 0.99), quantile(control_tpot, 0.99)
    limit = cp * (1.0 + margin)
    trip = sp > limit
    word = "exceeds" if trip else "within"
    reason = (f"spec TPOT p99 {sp * 1000:.1f} ms {word} control's {cp * 1000:.1f} ms + {margin:.0%} "
              f"({limit * 1000:.1f} ms) over {n_spec:.0f} spec / {n_control:.0f} control requests")
    return Verdict(trip, True, sp, cp, reason)
