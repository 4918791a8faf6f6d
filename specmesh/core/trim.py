"""Draft rows a shared forward verifies, chosen by the target for the whole batch. Pure.

Each coordinator chooses its request's k for goodput (core/goodput.py) one sequence at a time:
its draft against the forward it expects to share, the others priced at the rows they recently
packed. That marginal choice settles where no single draft pays to leave, not where the batch
does best. Measured on an AMX Xeon (docs/bench/round_policy.md#session-33): 16 sequences at 2 rows
each cost 1.46x 16 at one, so the batch is better off with no drafts at ~1.4 tokens per round;
yet once most sequences draft, one more row costs ~1-2% of the forward and buys about as much,
and the n-gram drafter stayed drafting at concurrency 16 after a concurrency-4 phase (0.94x AR).

The target sees the forward itself: every sequence gathered, every draft, its own cost table.
Given each chain's probability that its i-th draft is accepted (p_i, cumulative, sent by the
coordinator from the same per-request rates its k came from), it keeps the drafts that maximise
the forward's expected tokens per second,

    (B + fixed + sum of kept p) / T(rows that stay + kept rows),

over prefixes of the positions ranked by p (p falls along a chain, so every prefix of that
ranking keeps a prefix of each chain; verifying a draft's prefix is lossless at any temperature).
Drafts without p (trees, a request's explicit k, an older coordinator) are never trimmed and
count `fixed` expected tokens. Alone (one sequence) the coordinator's own choice stands: the rule
is the same, and its probe positions must be verified to be measured.
"""

from __future__ import annotations

from typing import Callable


def cumulative(rates: list[float] | tuple[float, ...], k: int) -> list[float]:
    """p_i = prod_{j<=i} a_j for i = 1..k (rates[j-1] = a_j; missing positions count as 0)."""
    out, run = [], 1.0
    for i in range(k):
        run *= min(1.0, max(0.0, rates[i])) if i < len(rates) else 0.0
        out.append(run)
    return out


def keep_counts(accept: list[list[float] | None], rows: int, fixed: float,
                cost: Callable[[int], float]) -> list[int | None]:
    """Per job, the draft positions to verify (None: not trimmable, verify as drafted).

    accept[j]: job j's p_1..p_k (None: not trimmable); rows: rows that stay in the forward
    whatever is kept (one per sequence plus untrimmable drafts); fixed: the tokens those emit
    (one per sequence at least); cost(r): seconds of a forward of r rows."""
    ranked = []  # (p, job, position): ties by job, then position, so chains keep prefixes
    for j, ps in enumerate(accept):
        run = 1.0
        for i, p in enumerate(ps or ()):
            run = min(run, max(0.0, p))  # a position is never likelier than the one before it
            ranked.append((run, j, i))
    ranked.sort(key=lambda t: (-t[0], t[1], t[2]))
    best_n, best_rate, tokens = 0, fixed / cost(rows), fixed
    for n, (p, _, _) in enumerate(ranked, start=1):
        tokens += p
        rate = tokens / cost(rows + n)
        if rate > best_rate * (1 + 1e-9):
            best_n, best_rate = n, rate
    keep: list[int | None] = [None if ps is None else 0 for ps in accept]
    for _, j, _ in ranked[:best_n]:
        keep[j] += 1
    return keep
