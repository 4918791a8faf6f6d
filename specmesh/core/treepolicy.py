"""A draft tree's node budget, chosen per round for goodput. Pure (no grpc, no torch).

Draft trees are best-first (specmesh/core/tree.py): the first n nodes of a tree of N >= n nodes
are exactly the tree a budget of n builds. So one round verified with N nodes tells how many
tokens every smaller budget would have emitted: the accepted path's nodes among the first n,
plus the target's own token,

    emitted(n) = 1 + #{accepted path nodes with index < n}      for n <= N.

TreePolicy keeps E(n), an exponential moving average of emitted(n) per budget n = 1..budget
(seeded from the drafter's book, RateBook.tree_seed), and each round takes the n in 0..budget
that maximises (others + E(n)) / T(B, n + 1), E(0) = 1 (no draft), as KPolicy does for a chain's
k (core/goodput.py). A drafter's wait is the same for any n (one block forward), so it is in T
for every n > 0. A choice moves only when the new n beats the one in force by a share of one
token (hysteresis), and every probe_every-th round drafts the whole budget, which measures every
n at once. Beside others (`beside`) a probe costs every sequence of the forward: it drafts the
largest budget whose predicted goodput stays within `probe_loss` of the budget in force (where
rows are nearly free, a GPU, still the whole budget), and none while the budget in force is 0:
a round that drafts from none waits for a table drafted on demand (no table is drafted for a
round without a draft), and the wait takes its sequence out of the batch's step whatever the
probe's size (the block tree at concurrency 16 on a 2-core AMX Xeon, session 35: 0.85-0.93x AR
with whole-budget probes, 0.89-0.93x with probes of 1-3 nodes, 0.92-0.97x with none). Alone a
probe costs only its own request: the whole budget. Where each verified row costs ~10% of a step
(float32 on a CPU without AMX, session 19) the best budget can be 2-4 nodes when the whole tree
does not pay; on a GPU, where 9 rows cost about one, the whole tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from specmesh.core.goodput import DEFAULT_TREE_SEED, best_of, seed_curve


def path_nodes(parents: list[int], draft: list[int], emitted: list[int]) -> list[int]:
    """Indices of the draft nodes the target accepted: walk from the root along the children
    whose tokens the target emitted, in order (siblings carry distinct tokens)."""
    path, node = [], -1
    for tok in emitted:
        nxt = next((i for i, p in enumerate(parents) if p == node and draft[i] == tok), None)
        if nxt is None:
            break
        path.append(nxt)
        node = nxt
    return path


def emitted_by_budget(path: list[int], covered: int) -> list[float]:
    """emitted(n) for n = 1..covered from one round's accepted path (node indices)."""
    return [1.0 + sum(1 for i in path if i < n) for n in range(1, covered + 1)]


@dataclass
class TreePolicy:
    """Per request: this round's node budget in 0..budget (see the module doc)."""

    budget: int
    seed: list[float] | float = DEFAULT_TREE_SEED  # E(1..budget), or the whole tree's tokens
    alpha: float = 0.2
    margin: float = 0.05
    probe_every: int = 16  # a probe costs budget rows: rarer than a chain's one extra position
    probe_loss: float = 0.03  # beside others: the goodput a probe may give up against the budget in force
    expected: list[float] = field(default_factory=list)  # E(n) at index n - 1
    nodes: int = -1  # the budget in force (-1: none chosen yet)
    rounds: int = 0
    history: dict[int, int] = field(default_factory=dict)  # nodes drafted -> rounds

    def __post_init__(self) -> None:
        seed = seed_curve(self.seed, self.budget) if isinstance(self.seed, (int, float)) else list(self.seed)
        seed = (seed + [seed[-1] if seed else 1.0] * self.budget)[: self.budget]
        self.expected = self.expected or [max(1.0, x) for x in seed]

    def tokens(self, n: int) -> float:
        return 1.0 if n <= 0 else self.expected[min(n, self.budget) - 1]

    def best(self, cost: Callable[[int], float], others: float = 0.0) -> tuple[int, float]:
        """(n, goodput) maximising (others + E(n)) / cost(n + 1); ties go to the smaller n."""
        return best_of(self.tokens, cost, self.budget, others)

    def choose(self, cost: Callable[[int], float], others: float = 0.0, beside: bool = False) -> int:
        """This round's node budget (cost and others as goodput.best_k's; beside: the forward is
        shared with live others, and a probe is priced: _probe)."""
        new, new_rate = self.best(cost, others)
        if self.nodes < 0:
            self.nodes = new
        elif new != self.nodes:
            if new_rate - self._rate(self.nodes, cost, others) > self.margin / cost(1):
                self.nodes = new
        self.rounds += 1
        probe = bool(self.probe_every) and self.rounds % self.probe_every == 0
        used = (self._probe(cost, others) if beside else self.budget) if probe else self.nodes
        self.history[used] = self.history.get(used, 0) + 1
        return used

    def _probe(self, cost: Callable[[int], float], others: float) -> int:
        """Beside others: the largest budget past the one in force whose goodput is within
        probe_loss of it; the budget in force where there is none or it is 0 (no probe)."""
        if self.nodes <= 0:
            return 0
        floor = (1 - self.probe_loss) * self._rate(self.nodes, cost, others)
        fits = [n for n in range(self.nodes + 1, self.budget + 1) if self._rate(n, cost, others) >= floor]
        return max(fits, default=self.nodes)

    def _rate(self, n: int, cost: Callable[[int], float], others: float) -> float:
        """The goodput of n nodes, (others + E(n)) / cost(n + 1), as best() weighs each n."""
        return (others + self.tokens(n)) / cost(n + 1)

    def update(self, per_budget: list[float]) -> None:
        """Fold one round in: per_budget[n - 1] = emitted(n) for the budgets it covered."""
        for i, x in enumerate(per_budget[: self.budget]):
            self.expected[i] += self.alpha * (x - self.expected[i])
