"""k per round for one request: fixed, or chosen for goodput (specmesh/core/goodput.py) from the
target's verify cost model (sent with every Prefill/Verify response) and this request's measured
acceptance, seeded from the coordinator's per-drafter rate book. A draft tree's node budget is
chosen the same way, n nodes in 0..tree_budget (core/treepolicy.py). No grpc here."""

from __future__ import annotations

from specmesh.config import AUTOREGRESSIVE_DRAFTERS
from specmesh.core.costmodel import VerifyCost
from specmesh.core.goodput import KPolicy, RateBook, best_k, expected_tokens, shared_cycle_s, skip_beats_drafting
from specmesh.core.ngram import MATCH_BUCKETS, is_match_key, match_key
from specmesh.core.pace import PROBE_ROUNDS
from specmesh.core.treepolicy import TreePolicy, emitted_by_budget, path_nodes
from specmesh.core.trim import cumulative
from specmesh.core.types import DraftProposal, MatchBucket


FRESH_MARGIN = 0.02  # a fresh table's predicted goodput must beat the tail's by this share


class RoundPolicy:
    def __init__(self, k_max: int, rate_book: RateBook | None = None, control=None, tree_budget: int = 0,
                 overlap: bool = False, fresh_tables: bool = True):
        self.k_max = k_max  # > 0: goodput (chains: k in 0..k_max; trees: the budget or none); 0: fixed
        self.overlap = overlap  # each round pre-drafts the next (coordinator/predraft.py)
        self.fresh_tables = fresh_tables  # alone, a tree round may wait for a fresh table (fresh_beats_tail)
        self.tree_budget = tree_budget  # > 0: the request drafts trees of up to this many nodes
        self.nodes = tree_budget  # this round's tree budget (k's call sets it; tree_budget when fixed)
        self.rate_book = rate_book or RateBook()
        self.control = control  # the admin hot switch: a k override fixes k
        self.policies: dict[str, KPolicy | TreePolicy] = {}
        self.cost: VerifyCost | None = None
        # EMA of seconds a round waits for a draft drafted on demand (not a pre-draft), by drafter:
        # per drafted token for drafters that draft one token per forward (AUTOREGRESSIVE_DRAFTERS),
        # per round for the others
        self.draft_s: dict[str, float] = {}
        self._probing = 0  # drafting rounds left in a probe of a losing drafter (core/pace.py)
        self._drafted_last = False  # whether this request's last round drafted
        self._bucket_rounds = 0  # rounds under an n-gram match bucket's key (_bucket_probe)

    def k(self, method: str, fixed_k: int, limit: int, ready: int = 0, coming: bool = False,
          paced: bool = True) -> int:
        """This round's k for `method` (fixed_k when goodput does not apply), at most `limit`.
        For a tree: fixed_k (its depth cap) when the tree runs this round, 0 when it does not.
        ready: draft tokens already drafted for this round (a pre-draft hit): they cost no wait.
        coming: a pre-draft that may still hit is in flight (a round that drafts waits for it).
        Under goodput, a k > 0 then passes the measured pace (core/pace.py): 0 where drafting
        emits slower than the target alone (a chain: at this request's expected tokens a round).
        paced false: no gate, for a drafter run where the context is (the local n-gram: no hop, no
        draft tier), whose cost the target's forward, which goodput prices, is all of. (Gated, the
        local n-gram's rounds, each a burst of decode_steps steps, were priced at their first
        step's tokens: 78-89% of rounds at k = 0 at concurrency 1, session 41.)"""
        policy = self._policy(method)
        self.nodes = self.tree_budget
        if policy is None:
            return max(0, min(fixed_k, limit))
        k = self._goodput_k(policy, method, fixed_k, limit, ready, coming)
        if not k or not paced:
            return k
        expected = expected_tokens(policy.rates, k) if isinstance(policy, KPolicy) else None
        return self._paced(method.split("~", 1)[0], k, expected)  # a tail's key: its drafter's pace

    def _paced(self, drafter: str, k: int, expected: float | None = None) -> int:
        """k through the pace book's gate (expected: this round's expected tokens, where known); a
        probe of a losing drafter drafts PROBE_ROUNDS rounds."""
        pace = self.rate_book.pace
        if pace is None:
            return k
        if self._probing > 0:
            self._probing -= 1
            return k
        got, losing_probe = pace.decide(drafter, k, expected)
        if losing_probe:
            self._probing = PROBE_ROUNDS - 1
        if not got:
            self.nodes = 0
        return got

    def observe(self, method: str, drafted: bool, seconds: float, tokens: int) -> None:
        """A round's wall seconds and emitted tokens, for the pace book (not for "off"; nor a
        drafting round right after one that did not draft: core/pace.py)."""
        settled, self._drafted_last = self._drafted_last, drafted
        if self.rate_book.pace is not None and method != "off" and (settled or not drafted):
            self.rate_book.pace.observe(method, drafted, seconds, tokens)

    def _goodput_k(self, policy, method: str, fixed_k: int, limit: int, ready: int, coming: bool) -> int:
        # the forward's other sequences: the target's live ones, not only its recent mean batch.
        # Speculation itself pulls sequences out of step (each waits for its own draft), which
        # shrinks the mean batch, which made drafting look cheap: a self-fulfilling loss (the pair
        # at concurrency 4, docs/pair.md). The live count is the batch a plain step would share.
        others = self._others()
        rows, tokens = self._beside()  # the others' rows in the forward and the tokens they buy
        draft_s = self.draft_s.get(method, 0.0)  # a drafting round also waits for its draft
        per_token = method in AUTOREGRESSIVE_DRAFTERS

        def wait(q: int) -> float:  # for the q - 1 drafts of q positions, less those ready
            return 0.0 if q - 1 <= ready else draft_s * (q - 1 - ready) if per_token else draft_s

        batch = others + 1  # the forward's sequences, this one included

        def seconds(q: int) -> float:
            return self.cost.estimate(rows + q, batch) + wait(q)

        if isinstance(policy, TreePolicy):  # n nodes, at most fixed_k deep
            self.nodes = policy.choose(seconds, tokens, beside=others >= 1)
            return max(0, min(fixed_k, limit)) if self.nodes else 0
        if self._in_step(method):
            # beside live others, in step: only what is drafted already (a pre-draft that hit), never
            # a wait. A round waiting for a draft made now misses the forward the others start
            # meanwhile and pulls its sequence out of step (each forward then holds a part of the
            # batch); a k = 0 round keeps the target's batch whole while its pre-draft drafts on.
            # (k <= ready: seconds(k + 1) has no wait in it)
            return policy.choose(seconds, limit=min(limit, ready), others=tokens) if ready > 0 else 0
        if per_token and others >= 1 and draft_s > 0:
            # beside live others, a round waiting for its draft leaves the target to them meanwhile:
            # the wait costs this sequence its share of the forwards, not everyone's (shared_cycle_s)
            return policy.choose(lambda q: shared_cycle_s(lambda r: self.cost.estimate(r, r / q), batch, q, wait(q)),
                                 limit=limit)
        k = policy.choose(seconds, limit=limit, others=tokens, probe=self._bucket_probe(method, policy))
        if self.overlap and per_token and ready == 0 and not coming and draft_s > 0:
            fit = self.predraft_tokens(method, 1)  # what the draft tier drafts during a plain step
            if fit and skip_beats_drafting(policy.rates, lambda q: self.cost.estimate(rows + q, batch), k, draft_s,
                                           fit - 1, tokens):
                return 0  # no wait now: this round's pre-draft makes the next one free
        return k

    def fresh_beats_tail(self, method: str, tail_key: str) -> bool:
        """Alone, a draft tree's round with a tail (`tail_key`, an older table's rows, no wait):
        whether waiting for a table at its own anchor instead (`method`'s tokens per round and
        measured wait) emits faster. A tail after a rejection holds the drafter's rows for the
        positions after a token it got wrong; a fresh table sees the target's own (offline on
        MT-Bench, 8 nodes: 0.79 accepted drafts a round fresh, 0.53 one position stale). Where a
        table costs little against a verify, the wait pays. Beside others never: a wait takes
        the sequence out of the batch's step (session 32)."""
        if not self.fresh_tables:
            return False
        fresh, tail = self._policy(method), self._policy(tail_key)
        if not isinstance(fresh, TreePolicy) or not isinstance(tail, TreePolicy) or self.beside_others():
            return False
        wait = self.draft_s.get(method)
        if wait is None:
            return False
        _, fresh_rate = fresh.best(lambda q: self.cost.estimate(q) + wait)
        _, tail_rate = tail.best(self.cost.estimate)
        return fresh_rate > tail_rate * (1 + FRESH_MARGIN)

    def predraft_tokens(self, method: str, q: int) -> int | None:
        """Tokens a draft model drafts while the target verifies q positions (a pre-draft's length,
        its first being the guess of the target's own token): T(q) / draft seconds per token, 2 to
        k_max + 1; None where not known yet (no cost model or no draft measured)."""
        draft_s = self.draft_s.get(method, 0.0)
        if method not in AUTOREGRESSIVE_DRAFTERS or draft_s <= 0 or self.cost is None or not self.cost.table:
            return None
        return max(2, min(self.k_max + 1, round(self._forward_s(q) / draft_s)))

    def predraft_budget_s(self, method: str, q: int) -> float | None:
        """Beside live others, where rounds take only what is drafted already (k), a pre-draft is
        not a fixed length but what the draft tier drafts while the target's forward of this round
        (q positions of ours beside the others') runs: that forward's estimated seconds. None
        elsewhere (alone, the length is predraft_tokens'). The others bring the rows they
        recently packed (_beside), as in the round's own estimate."""
        if self._policy(method) is None or not self._in_step(method):
            return None
        return self._forward_s(q)

    def _forward_s(self, q: int) -> float:
        """Seconds of the forward verifying q positions of this request beside the others' rows."""
        return self.cost.estimate(self._beside()[0] + q, self._others() + 1)

    def _in_step(self, method: str) -> bool:
        """Rounds take only ready pre-drafts (k) and pre-drafts have a time (predraft_budget_s): a
        draft model's, pre-drafted, beside live others. Needs a cost model (_policy)."""
        return self.overlap and method in AUTOREGRESSIVE_DRAFTERS and self.beside_others()

    def in_force(self, method: str, k: int) -> int:
        """This round's k without its probe (a goodput chain drafts one position further now and
        then to keep measuring it): what the later steps of an n-gram burst draft, so that a probe
        costs one step's row, not every step's. k itself where goodput does not choose k."""
        policy = self._policy(method)
        return min(k, policy.k) if isinstance(policy, KPolicy) and policy.k >= 0 else k

    def _bucket_probe(self, key: str, policy) -> bool | None:
        """A match bucket's round probes on the request's count of such rounds, every probe_every-th
        (split over five buckets, each bucket's own count seldom got there); None: the policy's."""
        if not is_match_key(key) or not isinstance(policy, KPolicy):
            return None
        self._bucket_rounds += 1
        return bool(policy.probe_every) and self._bucket_rounds % policy.probe_every == 0

    def by_match(self, method: str, limit: int) -> tuple[MatchBucket, ...]:
        """What a burst's later steps draft by their lookup's match length (the local n-gram, no pace
        gate: see k): per match bucket the k goodput chooses now at the bucket's rates (no probe,
        no hysteresis: each step's match is its own); () where goodput does not choose k."""
        policies = [self._policy(match_key(method, bucket)) for bucket in MATCH_BUCKETS]
        if not all(isinstance(p, KPolicy) for p in policies):
            return ()
        cap = max(0, min(limit, self.k_max))
        seconds = [0.0] + [self._forward_s(q) for q in range(1, cap + 2)]  # priced once for every bucket
        others = self._beside()[1]
        return tuple(MatchBucket(bucket, best_k(p.rates, seconds.__getitem__, cap, others)[0], tuple(p.rates))
                     for bucket, p in zip(MATCH_BUCKETS, policies))

    def accept(self, method: str, n: int) -> list[float] | None:
        """p_1..p_n of a chain of n drafts from this request's a_j: what the target trims a draft
        by beside others (core/trim.py); None where goodput does not choose k."""
        rates = self.rates(method)
        return cumulative(rates, n) if rates and n > 0 else None

    def rates(self, method: str) -> tuple[float, ...]:
        """This request's a_j for a chain drafter (empty where goodput does not choose k)."""
        policy = self.policies.get(method)
        return tuple(policy.rates) if isinstance(policy, KPolicy) and self._policy(method) is policy else ()

    def beside_others(self) -> bool:
        """Whether this request's forwards are shared with live others (the cost model's view)."""
        return self.cost is not None and self._others() >= 1

    def _others(self) -> float:
        return max(0.0, self.cost.mean_batch - 1, self.cost.live - 1)

    def _beside(self) -> tuple[float, float]:
        """(rows, tokens) the other sequences of this round's forward bring: each packs the rows and
        emits the tokens a sequence recently did per forward (the target's mean_rows / mean_tokens).
        Pricing the others at one row each made a draft at 4 sequences look like the 4 -> 5-row step
        while all of them drafted (4 -> 8 rows): n-gram at concurrency 4 ran 0.90x AR (session 20)."""
        n = self._others()
        return n * max(1.0, self.cost.mean_rows), n * max(1.0, self.cost.mean_tokens)

    def _policy(self, method: str) -> KPolicy | TreePolicy | None:
        """None: k is fixed (goodput off, the hot switch overrides k, or no cost model yet)."""
        if self.k_max <= 0 or method == "off" or self.cost is None or not self.cost.table:
            return None
        if self.control is not None and self.control.state.k is not None:
            return None
        if method not in self.policies:
            self.policies[method] = (TreePolicy(self.tree_budget, self.rate_book.tree_seed(method, self.tree_budget))
                                     if self.tree_budget > 0 else KPolicy(self.k_max, self.rate_book.seed(method, self.k_max)))
        return self.policies[method]

    def take_cost(self, cost: dict | None) -> None:
        if cost is not None:
            self.cost = VerifyCost.from_dict(cost)

    def learn(self, method: str, draft: DraftProposal, accepted: int, draft_s: float | None = 0.0,
              emitted: list[int] = ()) -> None:
        """Fold a round's outcome into the request's and the book's acceptance: a chain's per
        position, a tree's tokens per round for every node budget up to the one it drafted (from
        its accepted path, found by `emitted`, the tokens the round emitted); and draft_s, the time
        the round waited for a draft drafted on demand (a remote drafter's Propose; ~0 for local
        n-gram; None: the draft was a pre-draft, whose wait says nothing of drafting's cost)."""
        if not draft.token_ids or method == "off":
            return
        if draft_s is not None:
            if method in AUTOREGRESSIVE_DRAFTERS:
                draft_s /= len(draft.token_ids)
            old = self.draft_s.get(method)
            self.draft_s[method] = draft_s if old is None else old + 0.2 * (draft_s - old)
        policy = self.policies.get(method)
        if draft.parents is not None:
            path = path_nodes(draft.parents, draft.token_ids, list(emitted)[:accepted])
            if len(path) != accepted:
                raise ValueError(f"the emitted tokens follow {len(path)} of the {accepted} accepted tree nodes")
            # a tree of fewer nodes than its budget is what any larger budget builds (best-first)
            per_budget = emitted_by_budget(path, max(len(draft.token_ids), self.nodes))
            if isinstance(policy, TreePolicy):
                policy.update(per_budget)
            self.rate_book.tree_update(method, per_budget)
            return
        if isinstance(policy, KPolicy):
            policy.update(len(draft.token_ids), accepted)
        self.rate_book.update(method, len(draft.token_ids), accepted)
