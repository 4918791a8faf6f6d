"""Goodput-chosen speculation length: k per request and per round. Pure (no grpc, no torch).

The rule of vLLM's dynamic speculative decoding and of SmartSpec/TurboSpec: with a_j the rate at
which draft position j is accepted once position j-1 was, and T(B, q) the target's verify time
for q positions at batch B, a round of k drafts emits on average

    E(k) = 1 + sum_{i=1..k} prod_{j<=i} a_j      tokens (the target's own token always comes)

in the time of the forward that verifies its k + 1 positions. Alone (batch 1) choose k in
0..k_max maximising E(k) / T(k + 1). In a batch the forward is shared: B - 1 other sequences
emit about a token each in it and wait for it too, so the rule counts the whole forward,

    (B - 1 + E(k)) / T(B - 1 + k + 1)     (T by packed rows; B the larger of the target's live
                                          sequences and its recent mean batch)

which is E(k) / T(k + 1) at B = 1; at B = 16 a draft must pay for everyone's longer step. k = 0
is a candidate, so speculation switches itself off where it cannot pay (a loaded target, text
that does not copy its context, a drafter that does not fit it).

A draft model on its own tier drafts one token per forward, and its round waits for it. Alone,
the wait adds to the round. Beside live others the target does not wait with it: it verifies the
others' rounds meanwhile. So each sequence's round costs T(n (k + 1)) + wait, n being the share
of the B sequences not waiting for a draft (shared_cycle_s), and k maximises E(k) over that.
Pricing the wait as if it stalled everyone's forward chose k = 0 in 42% of the pair's rounds at
concurrency 4 (20-23% now, two runs; docs/pair.md).

A draft tree makes the same choice over its node budget (core/treepolicy.py): n nodes in
0..budget, from the tokens each n would have emitted in the rounds measured.

KPolicy keeps a_j per request (an exponential moving average over rounds, seeded from the
drafter's global rates), probes one position beyond the chosen k now and then so the estimate of
longer drafts does not starve, and moves k only when the new choice beats the current one by a
margin (hysteresis: a share of one token per k = 0 round), so k does not flap on noise.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Callable

from specmesh.core.ngram import match_key
from specmesh.core.pace import PaceBook

# a drafter's a_j before anything is measured: MT-Bench's n-gram rates, conditional (docs/bench)
DEFAULT_SEED = (0.3, 0.5, 0.8, 0.8, 0.8, 0.8, 0.8, 0.8)
# a draft model is a small sibling of the target (same tokenizer, same data): seeded optimistic,
# near the ~0.85 greedy agreement measured for the Qwen2.5-Coder 0.5B/1.5B pair (docs/pair.md), so
# its first rounds draft and measure; a draft model that does not fit is pulled down by the
# per-request EMA within a few rounds (each round measures at least its first position)
SEEDS = {"draft_model": (0.8,) * 8}
# the local n-gram's a_j by the length of the match its draft follows (core/ngram.py's buckets: 1,
# 2, 3, 4-7, 8+ tokens), measured offline on greedy SmolLM2-135M over 40 ShareGPT prompts x 64
# tokens (docs/bench/round_policy.md#session-41): a long match is a copy the target goes on with
SEEDS.update({match_key("ngram", n): rates for n, rates in (
    (1, (0.21, 0.51, 0.58, 0.67, 0.73, 0.75, 0.75, 0.75)),
    (2, (0.47, 0.59, 0.68, 0.69, 0.75, 0.75, 0.75, 0.75)),
    (3, (0.57, 0.69, 0.70, 0.80, 0.80, 0.80, 0.80, 0.80)),
    (4, (0.73, 0.76, 0.80, 0.82, 0.84, 0.85, 0.85, 0.85)),
    (8, (0.89, 0.91, 0.91, 0.91, 0.88, 0.88, 0.88, 0.88)))})
# tokens a whole draft-tree round emits before anything is measured (the block drafter's 8-16 node
# trees accept 1.6-1.8 per round on MT-Bench, docs/bench/drafters.md); a little below, so trees
# must earn it
DEFAULT_TREE_SEED = 1.5


def expected_tokens(rates: list[float], k: int) -> float:
    """E(k) = 1 + sum_{i<=k} prod_{j<=i} a_j (rates[j-1] = a_j; missing positions count as 0)."""
    total, run = 1.0, 1.0
    for i in range(k):
        run *= rates[i] if i < len(rates) else 0.0
        total += run
    return total


def best_of(tokens: Callable[[int], float], cost: Callable[[int], float], n_max: int,
            others: float = 0.0) -> tuple[int, float]:
    """(n, goodput) maximising (others + tokens(n)) / cost(n + 1) over n in 0..n_max, n drafts
    verified as n + 1 positions; ties go to the smaller n. cost(q): seconds of the forward that
    verifies this request's q positions (q >= 1) beside the others' rows; others: tokens the other
    sequences of that forward emit (0 alone)."""
    best, best_rate = 0, (others + tokens(0)) / cost(1)
    for n in range(1, n_max + 1):
        rate = (others + tokens(n)) / cost(n + 1)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = n, rate
    return best, best_rate


def best_k(rates: list[float], cost: Callable[[int], float], k_max: int, others: float = 0.0) -> tuple[int, float]:
    """best_of for a chain: k drafts emit expected_tokens(rates, k)."""
    return best_of(lambda k: expected_tokens(rates, k), cost, k_max, others)


def seed_curve(whole: float, budget: int) -> list[float]:
    """A draft tree's tokens per round with n = 1..budget nodes before anything is measured, from
    `whole` with all `budget` nodes: concave (the first nodes are the drafter's likeliest),
    1 + (whole - 1) * sqrt(n / budget)."""
    gain = max(0.0, whole - 1.0)
    return [1.0 + gain * math.sqrt(n / budget) for n in range(1, budget + 1)]


@dataclass
class KPolicy:
    """Per request: a_j estimates and the k in force. seed: the drafter's global a_j."""

    k_max: int
    seed: list[float]
    alpha: float = 0.2  # EMA weight of the newest round
    # a new k must beat the current one's goodput by this share of one token per k = 0 round: an
    # absolute margin, since beside B - 1 others every k's goodput is within a few % of the rest
    margin: float = 0.05
    probe_every: int = 8  # every n-th round drafts one position more than chosen (if k_max allows)
    rates: list[float] = field(default_factory=list)
    k: int = -1  # the k in force (-1: none chosen yet)
    rounds: int = 0
    history: dict[int, int] = field(default_factory=dict)  # chosen k -> rounds

    def __post_init__(self) -> None:
        self.rates = [min(1.0, max(0.0, x)) for x in self.seed[: self.k_max]]
        self.rates += [0.0] * (self.k_max - len(self.rates))

    def choose(self, cost: Callable[[int], float], limit: int | None = None, others: float = 0.0,
               probe: bool | None = None) -> int:
        """This round's k (<= limit, e.g. the tokens left minus one); cost and others as best_k's.
        probe: whether this round probes one position further (None: every probe_every-th of this
        policy's rounds; a caller whose rounds spread over several policies keeps the count)."""
        cap = self.k_max if limit is None else max(0, min(self.k_max, limit))
        new, new_rate = best_k(self.rates, cost, cap, others)
        if self.k < 0 or self.k > cap:
            self.k = new
        elif new != self.k:
            current = (others + expected_tokens(self.rates, self.k)) / cost(self.k + 1)
            if new_rate - current > self.margin / cost(1):  # margin: a share of one token's worth
                self.k = new
        k = self.k
        self.rounds += 1
        if probe is None:
            probe = bool(self.probe_every) and self.rounds % self.probe_every == 0
        if probe and k < cap:
            k += 1  # probe one position further so its rate keeps being measured
        self.history[k] = self.history.get(k, 0) + 1
        return k

    def update(self, drafted: int, accepted: int) -> None:
        """Fold one round in: positions 1..accepted were accepted, position accepted+1 (if drafted)
        was rejected; positions past it were not tried (conditional rates: no information)."""
        for j in range(min(drafted, accepted + 1)):
            hit = 1.0 if j < accepted else 0.0
            self.rates[j] += self.alpha * (hit - self.rates[j])


class RateBook:
    """Process-wide a_j per drafter: each request's KPolicy starts from its drafter's entry and
    folds its rounds back in, so new requests start from what the mesh has seen (thread-safe).
    pace: the process-wide measured pace of drafting vs the target alone (core/pace.py), None: no
    gate (speculative.pace_gate false)."""

    def __init__(self, alpha: float = 0.02, pace: PaceBook | None = None):
        self.alpha = alpha
        self.pace = pace
        self._rates: dict[str, list[float]] = {}
        self._trees: dict[str, list[float]] = {}  # tokens per draft-tree round by node budget, by drafter
        self._lock = threading.Lock()

    def seed(self, method: str, k_max: int) -> list[float]:
        with self._lock:
            rates = self._rates.get(method) or list(SEEDS.get(method, DEFAULT_SEED))
        return (rates + [rates[-1]] * k_max)[:k_max]

    def update(self, method: str, drafted: int, accepted: int) -> None:
        with self._lock:
            rates = self._rates.setdefault(method, list(SEEDS.get(method, DEFAULT_SEED)))
            rates += [rates[-1]] * (drafted - len(rates))
            for j in range(min(drafted, accepted + 1)):
                rates[j] += self.alpha * ((1.0 if j < accepted else 0.0) - rates[j])

    def tree_seed(self, method: str, budget: int) -> list[float]:
        """Tokens per tree round with n = 1..budget nodes the mesh has seen for `method`
        (seed_curve of DEFAULT_TREE_SEED before any)."""
        with self._lock:
            seen = list(self._trees.get(method, ()))
        seed = seed_curve(DEFAULT_TREE_SEED, budget)
        return seen[:budget] + seed[len(seen):]

    def tree_update(self, method: str, per_budget: list[float]) -> None:
        """Fold one tree round in: per_budget[n - 1] = the tokens n nodes would have emitted."""
        with self._lock:
            rates = self._trees.setdefault(method, [])
            if len(rates) < len(per_budget):
                rates += seed_curve(DEFAULT_TREE_SEED, len(per_budget))[len(rates):]
            for i, x in enumerate(per_budget):
                rates[i] += self.alpha * (x - rates[i])

    def snapshot(self) -> dict[str, list[float]]:
        with self._lock:
            return {m: list(r) for m, r in self._rates.items()}


def shared_cycle_s(cost: Callable[[float], float], batch: float, q: int, wait_s: float, rounds: int = 3) -> float:
    """Seconds of one sequence's round at concurrency `batch` when every live sequence drafts
    q - 1 tokens on another tier and waits wait_s for them: while a sequence waits for its draft,
    the target verifies the others', so the forward holds only the share n of the sequences that
    is not waiting, n / batch = T / (T + wait_s) (at least one), each with q rows. The round takes
    T(n q) + wait_s; the sequence's goodput E(k) / that, and the mesh's batch times it. With
    wait_s = 0 it is T(batch q): everyone's rows in one forward. cost(rows): the target's forward."""
    n = max(1.0, batch)
    seconds = cost(n * q)
    for _ in range(rounds):  # a fixed point: 2-3 rounds settle it to a few ms
        n = max(1.0, batch * seconds / (seconds + wait_s))
        seconds = cost(n * q)
    return seconds + wait_s


def skip_beats_drafting(rates: list[float], cost: Callable[[int], float], k: int, draft_s: float,
                        ready_after_hit: int, others: float = 0.0) -> bool:
    """Drafting overlapped with verification (coordinator/predraft.py), a draft model that drafts
    one token per forward, and no pre-draft ready (the last round missed): True when a round
    without a draft beats drafting k tokens now and waiting k * draft_s for them.

    Each round pre-drafts the next one during its verify; the pre-draft hits when every draft was
    accepted and the target's own token is the drafter's next (rate a_1), and then the next round
    has `ready_after_hit` tokens (R) at no wait. The per-round rule (best_k) sees only this round,
    so it prices a round without a draft at one token and misses that its pre-draft makes the next
    round free: with a draft that costs half a target step per token, it always drafts now. Here
    both choices are priced to the next miss (a renewal cycle), with c = p_R * a_1 the chance that
    a ready round is followed by another and p_i = prod_{j<=i} a_j:

        ready rounds:  W_tok = (others + E(R)) / (1 - c),   W_s = T(R + 1) / (1 - c)
        no draft:      (others + 1 + a_1 W_tok)       / (T(1) + a_1 W_s)
        draft k now:   (others + E(k) + p_k a_1 W_tok) / (T(k + 1) + k draft_s + p_k a_1 W_s)

    cost(q): seconds of the forward verifying q positions beside the others' rows."""
    if k <= 0 or ready_after_hit <= 0 or not rates:
        return False
    g = rates[0]

    def p(i: int) -> float:
        out = 1.0
        for a in rates[:i]:
            out *= a
        return out

    cont = min(p(ready_after_hit) * g, 0.99)
    w_tok = (others + expected_tokens(rates, ready_after_hit)) / (1 - cont)
    w_s = cost(ready_after_hit + 1) / (1 - cont)
    skip = (others + 1 + g * w_tok) / (cost(1) + g * w_s)
    hit = p(k) * g
    now = (others + expected_tokens(rates, k) + hit * w_tok) / (cost(k + 1) + k * draft_s + hit * w_s)
    return skip > now
