"""k per round for one request: fixed, or chosen for goodput (specmesh/core/goodput.py) from the
target's verify cost model (sent with every Prefill/Verify response) and this request's measured
acceptance, seeded from the coordinator's per-drafter rate book. No grpc here."""

from __future__ import annotations

from specmesh.core.costmodel import VerifyCost
from specmesh.core.goodput import KPolicy, RateBook
from specmesh.core.types import DraftProposal


class RoundPolicy:
    def __init__(self, k_max: int, rate_book: RateBook | None = None, control=None):
        self.k_max = k_max  # > 0: goodput in 0..k_max; 0: fixed
        self.rate_book = rate_book or RateBook()
        self.control = control  # the admin hot switch: a k override fixes k
        self.policies: dict[str, KPolicy] = {}
        self.cost: VerifyCost | None = None

    def k(self, method: str, fixed_k: int, limit: int) -> int:
        """This round's k for `method` (fixed_k when goodput does not apply), at most `limit`."""
        policy = self._policy(method)
        if policy is None:
            return max(0, min(fixed_k, limit))
        cost = self.cost
        return policy.choose(lambda q: cost.round_cost(q), limit=limit)

    def _policy(self, method: str) -> KPolicy | None:
        """None: k is fixed (goodput off, the hot switch overrides k, or no cost model yet)."""
        if self.k_max <= 0 or method == "off" or self.cost is None or not self.cost.table:
            return None
        if self.control is not None and self.control.state.k is not None:
            return None
        if method not in self.policies:
            self.policies[method] = KPolicy(self.k_max, self.rate_book.seed(method, self.k_max))
        return self.policies[method]

    def take_cost(self, cost: dict | None) -> None:
        if cost is not None:
            self.cost = VerifyCost.from_dict(cost)

    def learn(self, method: str, draft: DraftProposal, accepted: int) -> None:
        """Fold a chain round's outcome into the request's and the book's acceptance rates."""
        if draft.parents is None and draft.token_ids and method != "off":
            if method in self.policies:
                self.policies[method].update(len(draft.token_ids), accepted)
            self.rate_book.update(method, len(draft.token_ids), accepted)
