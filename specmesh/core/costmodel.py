"""A target worker's verify cost model: seconds of one forward by the rows it packs. Pure.

The engine packs every sequence's new positions into one forward (specmesh/engine/kv.py), so a
forward's time follows its total row count T = sum over the batch of (k_b + 1), plus a small
per-sequence part (attention). The model keeps the seconds of a forward at a few row counts
(ROWS), seeded by a measurement at start-up and kept current from every batch the worker runs.

Two parts, in logs: a **drift** shared by every bucket (how fast the machine runs now) and a
**shape** per bucket (what its forward costs next to the others). Each observation moves the
drift (alpha); it moves its own bucket's shape (alpha / 4) only when another bucket was observed
among the last few forwards, i.e. when the machine's speed of the moment is known from more than
this bucket (a run of one bucket alone cannot tell a slower machine from a dearer bucket, and
goes to the drift). So a bucket observed rarely still follows the machine, and a bucket observed
in a loaded minute does not keep that minute's time. This VM's speed moves by up to ~30% between
minutes: with one EMA per bucket (until session 20) the buckets held times from different
minutes, and tables like 1 row 68.5 ms, 5 rows 62.9 ms
(the end of a session-19 run) or 1 row 41.8, 2 rows 56.9 ms told the goodput rule that drafts were
free or dear, while the rows' own times, logged over one run at concurrency 1, kept medians of
37.6 / 36.7 / 44.7 ms for 1 / 2 / 5 rows. (The even older rule, every bucket multiplied by every
observation's relative move, let a 65-row bucket no batch reached drift to 16x a one-row step.)

Any row count is answered by linear interpolation (beyond the last bucket: linear extrapolation
from the last two) over the buckets' monotone fit (pool adjacent violators): a forward of more
rows never costs less than one of fewer.

**Beside others, by batch.** A forward of B sequences is not priced as one sequence's chain of
the same rows: measured (docs/bench/engine.md, micro, one row per sequence, ms) a Zen 4 EPYC's
4 sequences 23.7 against one sequence's step 32.6, 16 sequences 48.8 against a 17-row chain 45.5;
an AMX Xeon's 16 sequences at 2 rows each 60.6, where the rows table, filled at 32 rows mostly by
4 sequences at 8, read 1.27-1.31x its 16 rows (measured 1.46x). So forwards of B >= 2 sequences
have their own model, by batch bucket b (BATCHES): the one-row step S_b (B sequences, one row each:
its shape in logs with the same drift) and the seconds each extra row adds, m_b, fitted from the
forwards at that batch that pack more: EMA(T - S(B)) / EMA(rows - B). T(B, rows) = S(B) +
m(B) (rows - B), S and m interpolated over the buckets (S from one sequence's one-row step at B =
1). It is linear in the extra rows, so one sequence's draft and everyone's are priced alike: the
target's batch-wide trim (core/trim.py) and the coordinators' k see the same price per row.
Where a batch has no S or m yet, the rows table stands in: S(B) + rows(R) - rows(B).

What the coordinator needs for the goodput rule (core/goodput.py) is the time of the forward
that verifies a request's q positions beside B - 1 other sequences' rows: estimate((B - 1) r + q),
with B the larger of the worker's live sequences (live, sent with the table) and its recent mean
batch (mean_batch), and r the rows each sequence has recently packed per forward (mean_rows: 1
where nobody drafts, more where the others draft too; with r = 1, as until session 20, the rule
priced a draft at 4 sequences by the 4 -> 5-row step, ~3% of a forward on this CPU, while every
sequence drafted and the real step was 4 -> 8 rows, ~39%). mean_tokens: the tokens each sequence
has recently emitted per forward (what the others' rows buy).
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import deque

ROWS = (1, 2, 3, 5, 9, 17, 33, 65)  # buckets: a one-token step, chains of k=1..16, a few batches
BATCHES = (2, 4, 8, 16, 32, 64)  # forwards of several sequences: their one-row step and per-row slope
SLOPE = 1 << 20  # recent-observation keys: rows r, a batch's one-row step -b, its slope SLOPE + b
RECENT = 4  # a bucket's shape learns when another bucket was among this many last observations


class VerifyCost:
    def __init__(self, seconds: dict[int, float] | None = None, alpha: float = 0.1):
        self.alpha = alpha  # the drift's EMA weight; a bucket's shape moves at alpha / 4
        self._lock = threading.Lock()
        self._drift = 0.0  # log of the machine's speed now against the shape's (shared)
        self._recent: deque[int] = deque(maxlen=RECENT)  # the buckets of the last RECENT observations
        self._shape: dict[int, float] = {r: math.log(s) for r, s in (seconds or {}).items() if s > 0}
        self._step: dict[int, float] = {}  # batch bucket -> log seconds of its one-row step, less the drift
        self._slope: dict[int, float] = {}  # batch bucket -> seconds per extra row, at drift 0
        self._slope_sums: dict[int, tuple[float, float]] = {}  # batch bucket -> EMA (extra s, extra rows)
        self.table: dict[int, float] = {}  # seconds per bucket now: exp(shape + drift), by rows
        self._fit: tuple[list[int], list[float]] = ([], [])  # the table's rows, its monotone fit
        self._refresh()
        self.mean_batch = 1.0
        self.mean_rows = 1.0  # rows per sequence per forward (EMA)
        self.mean_tokens = 1.0  # tokens emitted per sequence per forward (EMA; observe's tokens)
        self.live = 0  # sequences the worker holds (set by the worker when it sends the table)

    def observe(self, rows: int, seconds: float, batch: int = 1, tokens: int | None = None) -> None:
        """Fold in one forward of `rows` packed rows over `batch` sequences that emitted `tokens`."""
        if rows < 1 or seconds <= 0:
            return
        with self._lock:
            if batch >= 2:
                self._observe_batch(rows, seconds, batch)
            else:
                self._observe_rows(rows, seconds)
            self.mean_batch += self.alpha * (batch - self.mean_batch)
            self.mean_rows += self.alpha * (rows / max(1, batch) - self.mean_rows)
            if tokens is not None:
                self.mean_tokens += self.alpha * (tokens / max(1, batch) - self.mean_tokens)

    def _observe_rows(self, rows: int, seconds: float) -> None:
        """One sequence's forward: the rows table (drift and shape)."""
        bucket = min(ROWS, key=lambda r: abs(r - rows))
        if abs(bucket - rows) <= max(1, bucket // 4):  # close enough to stand for the bucket
            self._follow(self._shape, bucket, bucket, math.log(seconds))

    def _follow(self, shapes: dict[int, float], key: int, tag: int, now: float) -> None:
        """One forward of log seconds `now` standing for shapes[key]: the drift moves (alpha), and
        the key's shape (alpha / 4) when another key was among the last observations (tag: this
        key's name there), i.e. when the drift is known from more than this one."""
        if key not in shapes:  # first seen: its shape is this forward at today's drift
            shapes[key] = now - self._drift
        self._drift += self.alpha * (now - self._drift - shapes[key])
        if any(r != tag for r in self._recent):
            shapes[key] += self.alpha / 4 * (now - self._drift - shapes[key])
        self._recent.append(tag)
        self._refresh()

    def _observe_batch(self, rows: int, seconds: float, batch: int) -> None:
        """A forward of `batch` sequences: its bucket's one-row step (drift and shape, as a row
        bucket's) when every sequence packed one row, else the drift and the bucket's per-extra-row
        slope."""
        b = min(BATCHES, key=lambda x: abs(x - batch))
        if abs(b - batch) > max(1, b // 4) or (rows > batch and b not in self._step):
            self._observe_rows(rows, seconds)  # no one-row step of this batch known: the rows table learns
            return
        now = math.log(seconds)
        if rows <= batch:
            self._follow(self._step, b, -b, now)  # batch buckets as negative keys beside the row buckets
        else:
            # the drift follows this forward as priced now (where the machine's speed moves while
            # most forwards draft, the slope must not take it up), then the slope takes the rest:
            # extra seconds over extra rows, each an EMA, so a forward of many extra rows weighs
            # more than one of a few, whose extra seconds are mostly noise; not clipped per forward
            # (clipping noise at 0 biased the slope up), only when read
            # (as a bucket's shape: only while other forwards were seen lately, which tell the drift)
            plain, slope = self._plain(batch), self._slope.get(b)
            if slope is not None:
                self._drift += self.alpha * (now - self._drift - math.log(plain + slope * (rows - batch)))
                self._refresh()
            known = any(r != SLOPE + b for r in self._recent)
            self._recent.append(SLOPE + b)
            if slope is not None and not known:
                return
            extra = seconds * math.exp(-self._drift) - plain  # drift 0
            num, den = self._slope_sums.get(b, (slope or 0.0, 1.0))
            w = self.alpha / 2
            num, den = num + w * (extra - num), den + w * (rows - batch - den)
            self._slope_sums[b] = (num, den)
            self._slope[b] = max(0.0, num / den)

    def _plain(self, batch: float) -> float:
        """Seconds (drift 0) of a forward of `batch` sequences at one row each: the batch buckets'
        steps, and one sequence's one-row step at 1, interpolated (past the last: extended)."""
        pts = sorted((b, math.exp(v)) for b, v in self._step.items())
        if 1 in self._shape:
            pts.insert(0, (1, math.exp(self._shape[1])))
        return _interp(pts, batch)

    def _refresh(self) -> None:
        """The table and its monotone fit from shape and drift (once per change, not per estimate)."""
        self.table = {r: math.exp(s + self._drift) for r, s in sorted(self._shape.items())}
        self._fit = (list(self.table), monotone(list(self.table.values())))

    def seed(self, seconds: dict[int, float]) -> None:
        """Start-up measurements: the buckets' shape at the drift in force."""
        with self._lock:
            self._shape.update({r: math.log(s) - self._drift for r, s in seconds.items() if s > 0})
            self._refresh()

    def seed_batches(self, steps: dict[int, float], slopes: dict[int, float]) -> None:
        """Start-up measurements of several sequences: one-row steps and per-extra-row seconds by
        batch bucket, at the drift in force."""
        with self._lock:
            scale = math.exp(-self._drift)
            self._step.update({b: math.log(s) - self._drift for b, s in steps.items() if s > 0})
            self._slope.update({b: max(0.0, m) * scale for b, m in slopes.items()})

    def estimate(self, rows: float, batch: float = 1.0) -> float:
        """Seconds of a forward of `rows` rows over `batch` sequences (interpolated; 1.0 per row
        when nothing is known). batch < 1.5: one sequence's chain, the rows table."""
        if batch >= 1.5:
            with self._lock:
                if self._step:
                    return self._estimate_batch(rows, batch)
        return self._estimate_rows(rows)

    def _estimate_batch(self, rows: float, batch: float) -> float:
        """S(B) + m(B) (rows - B) at the drift in force, the extra rows priced at least as the rows
        table prices the same rows (one sequence's step from B to rows rows: the linears pay per
        row whoever's it is). A batch bucket's slope is a noisy EMA: seen at 0.01-0.10 ms a row at 8
        sequences beside 0.8-2.5 ms at 2, 4 and 16 in one run (session 41), which priced drafts at
        load as nearly free (the floor only within the rows the table measured). Without any slope
        measured, the rows table's step alone."""
        plain = self._plain(batch) * math.exp(self._drift)
        extra = max(0.0, rows - batch)
        if not extra:
            return plain
        floor = max(0.0, self._rows_fit(rows) - self._rows_fit(batch))
        if not self._slope:
            return plain + floor
        sloped = extra * _interp(sorted(self._slope.items()), batch) * math.exp(self._drift)
        xs = self._fit[0]
        known = len(xs) >= 2 and rows <= xs[-1]  # the floor only within the rows the table measured
        return plain + (max(floor, sloped) if known else sloped)

    def _estimate_rows(self, rows: float) -> float:
        with self._lock:
            return self._rows_fit(rows)

    def _rows_fit(self, rows: float) -> float:
        xs, ys = self._fit  # sorted by rows; replaced whole on change, never mutated
        if not xs:
            return float(rows)
        if rows <= xs[0]:
            return ys[0]
        if len(xs) == 1:
            return ys[0] * rows / xs[0]
        i = min(bisect.bisect_left(xs, rows), len(xs) - 1)  # past the last bucket: extend its segment
        x0, y0, x1, y1 = xs[i - 1], ys[i - 1], xs[i], ys[i]
        return max(ys[0], y0 + (y1 - y0) * (rows - x0) / (x1 - x0))

    def as_dict(self) -> dict:
        with self._lock:
            scale = math.exp(self._drift)
            batches = sorted(self._step)
            return {"rows": list(self.table), "seconds": list(self.table.values()), "mean_batch": self.mean_batch,
                    "live": self.live, "mean_rows": self.mean_rows, "mean_tokens": self.mean_tokens,
                    "batches": batches, "batch_seconds": [math.exp(self._step[b]) * scale for b in batches],
                    "batch_slopes": [self._slope[b] * scale if b in self._slope else -1.0 for b in batches]}

    @classmethod
    def from_dict(cls, data: dict) -> VerifyCost:
        cost = cls(dict(zip((int(r) for r in data.get("rows", ())), (float(s) for s in data.get("seconds", ())))))
        cost.mean_batch = float(data.get("mean_batch", 1.0))
        cost.mean_rows = float(data.get("mean_rows", 1.0))
        cost.mean_tokens = float(data.get("mean_tokens", 1.0))
        cost.live = int(data.get("live", 0))
        for b, sec, slope in zip(data.get("batches", ()), data.get("batch_seconds", ()), data.get("batch_slopes", ())):
            if sec > 0:
                cost._step[int(b)] = math.log(sec)
                if slope >= 0:
                    cost._slope[int(b)] = float(slope)
        return cost


def _interp(pts: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through sorted points: the first y below them, the last segment
    extended past them where it rises, the last y where it falls. (Extending a falling segment,
    a batch bucket's step learnt in a faster minute than the one before it, priced a forward of
    more sequences at 0 seconds: a ZeroDivisionError in a coordinator's goodput rule, CI of
    session 35.)"""
    if not pts:
        return 0.0
    if x <= pts[0][0] or len(pts) == 1:
        return pts[0][1]
    i = min(bisect.bisect_left([p for p, _ in pts], x), len(pts) - 1)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    if x > x1 and y1 < y0:
        return y1
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def monotone(ys: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of ys (pool adjacent violators, equal weights): each
    run of values that falls is replaced by its mean, merged leftwards until the sequence rises."""
    blocks: list[list[float]] = []  # [mean, count]
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return [m for m, n in blocks for _ in range(int(n))]
