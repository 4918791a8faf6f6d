"""A target worker's verify cost model: seconds of one forward by the rows it packs. Pure.

The engine packs every sequence's new positions into one forward (specmesh/engine/kv.py), so a
forward's time follows its total row count T = sum over the batch of (k_b + 1), plus a small
per-sequence part (attention). The model keeps the seconds of a forward at a few row counts
(ROWS), seeded by a measurement at start-up and kept current from every batch the worker runs
(an exponential moving average at the nearest bucket; a bucket not observed since start-up is its
start-up time times the observed buckets' geometric mean drift from theirs, so the curve keeps its
shape when the whole machine slows down, and noise cannot walk it away: multiplying it by every
observation's relative move, as this did until session 11, let a 65-row bucket no batch reached
drift to 16x a one-row step on a Zen 4 run), and answers any row count by linear
interpolation (beyond the last bucket: linear extrapolation from the last two).

What the coordinator needs for the goodput rule (core/goodput.py) is the time of the forward
that verifies a request's q positions beside B - 1 other sequences' rows: estimate(B - 1 + q),
with B the larger of the worker's live sequences (live, sent with the table) and its recent mean
batch (mean_batch).
"""

from __future__ import annotations

import bisect
import math
import threading

ROWS = (1, 2, 3, 5, 9, 17, 33, 65)  # buckets: a one-token step, chains of k=1..16, a few batches


class VerifyCost:
    def __init__(self, seconds: dict[int, float] | None = None, alpha: float = 0.1):
        self.alpha = alpha
        # buckets observed since start-up; the others follow the observed ones' drift from start-up:
        # a bucket known only from start-up (say 2 rows, while the mesh runs 1-row steps) would
        # otherwise keep an idle machine's time and the curve bend (2 rows "cheaper" than 1)
        self._seen: set[int] = set()
        self._lock = threading.Lock()
        self.table: dict[int, float] = dict(sorted((seconds or {}).items()))
        self._start: dict[int, float] = dict(self.table)  # start-up (seeded) seconds per bucket
        self.mean_batch = 1.0
        self.live = 0  # sequences the worker holds (set by the worker when it sends the table)

    def observe(self, rows: int, seconds: float, batch: int = 1) -> None:
        """Fold in one forward of `rows` packed rows over `batch` sequences."""
        if rows < 1 or seconds <= 0:
            return
        with self._lock:
            bucket = min(ROWS, key=lambda r: abs(r - rows))
            if abs(bucket - rows) <= max(1, bucket // 4):  # close enough to stand for the bucket
                old = self.table.get(bucket)
                self.table[bucket] = seconds if old is None else old + self.alpha * (seconds - old)
                self._seen.add(bucket)
                self._follow()
            self.mean_batch += self.alpha * (batch - self.mean_batch)

    def _follow(self) -> None:
        """Buckets not observed: start-up seconds x the observed buckets' geometric mean drift
        (observed / start-up). Caller holds the lock."""
        ratios = [math.log(self.table[r] / s) for r, s in self._start.items() if r in self._seen and s > 0]
        drift = math.exp(sum(ratios) / len(ratios)) if ratios else 1.0
        table = {r: (s if r in self._seen else self._start.get(r, s) * drift) for r, s in self.table.items()}
        self.table = dict(sorted(table.items()))

    def seed(self, seconds: dict[int, float]) -> None:
        """Start-up measurements (not observations: they follow the machine's drift later)."""
        with self._lock:
            self._start.update(seconds)
            self.table = dict(sorted({**self.table, **seconds}.items()))
            self._follow()

    def estimate(self, rows: float) -> float:
        """Seconds of a forward of `rows` rows (interpolated; 1.0 per row when nothing is known)."""
        with self._lock:
            pts = list(self.table.items())  # kept sorted by rows
        if not pts:
            return float(rows)
        xs, ys = [x for x, _ in pts], [y for _, y in pts]
        if rows <= xs[0]:
            return ys[0]
        if len(xs) == 1:
            return ys[0] * rows / xs[0]
        i = min(bisect.bisect_left(xs, rows), len(xs) - 1)  # past the last bucket: extend its segment
        x0, y0, x1, y1 = xs[i - 1], ys[i - 1], xs[i], ys[i]
        return max(ys[0], y0 + (y1 - y0) * (rows - x0) / (x1 - x0))

    def as_dict(self) -> dict:
        with self._lock:
            return {"rows": list(self.table), "seconds": list(self.table.values()), "mean_batch": self.mean_batch,
                    "live": self.live}

    @classmethod
    def from_dict(cls, data: dict) -> VerifyCost:
        cost = cls(dict(zip((int(r) for r in data.get("rows", ())), (float(s) for s in data.get("seconds", ())))))
        cost.mean_batch = float(data.get("mean_batch", 1.0))
        cost.live = int(data.get("live", 0))
        return cost
