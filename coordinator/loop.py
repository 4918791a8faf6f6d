"""The per-request speculative decoding loop. Talks to the tiers only through two small
interfaces (TargetClient, DraftPool), so it knows nothing of protobuf.

    prefill(prompt) -> t_1                         (target; first token, TTFT)
    repeat until eos / max_tokens / stop string:
        d_1..d_k = propose(context)                (draft tier; on failure k = 0)
        n, tokens = verify(d_1..d_k)               (target; tokens = d_1..d_n + one target token)
        stream tokens
    release(seq)                                    (always: finish, cancel or error)

Target failover (only when a `reroute` callable is given, as the coordinator does): if the
target worker holding the sequence fails (UNAVAILABLE: died, draining, full; NOT_FOUND: it
restarted and lost the cache; or one call outlives target_timeout_s), the sequence is
re-prefilled on another target with prompt + every token emitted so far, whose first token is
the next output token, at most max_reroutes times; then the request fails UNAVAILABLE. At T=0
the output is unchanged; at T>0 the sampling stream restarts (same distribution, other draws).

Block drafter (method "block", given a feature_spec): prefill and every verify also return the
target's features of the positions they commit; the loop keeps the newest window of them
(FeatureFeed) and sends each round only the rows the draft tier has not seen, or the whole window
when the draft worker reports a miss (one more Propose). With a tree budget the draft is a tree,
verified by the target in one forward.
"""

from __future__ import annotations

import dataclasses

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Iterator, Protocol

from specmesh.config import FEATURE_DRAFTERS
from coordinator.drafting import Drafting, feature_nbytes
from coordinator.tails import Tails
from coordinator.predraft import Predrafter
from coordinator.roundpolicy import RoundPolicy
from specmesh.core.features import FeatureFeed
from specmesh.core.goodput import RateBook
from specmesh.core.tree import DraftTree
from specmesh.core.types import (DraftProposal, FeatureSpec, GenerationRequest, SamplingParams, SpecStats,
                                 VerifyOutcome)
from specmesh.errors import Cancelled, DeadlineExceeded, NotFound, SpecmeshError, Unavailable
from specmesh.tokenization import OutputAssembler

log = logging.getLogger(__name__)


class TargetClient(Protocol):
    def prefill(self, seq_id: str, prompt: list[int], params: SamplingParams, timeout: float,
                max_new_tokens: int = 0) -> int: ...
    def verify(self, seq_id: str, draft: DraftProposal, timeout: float) -> VerifyOutcome: ...
    def release(self, seq_id: str) -> None: ...


class DraftPool(Protocol):
    def propose(self, seq_id: str, context: list[int], k: int, method: str, params: SamplingParams,
                round_: int, timeout: float, calls: list | None = None, budget_s: float = 0.0) -> DraftProposal: ...
    def release(self, seq_id: str) -> None: ...
    # optional: def available(self, method: str) -> bool (a worker may be asked now; Drafting._tier_up)


@dataclass
class Chunk:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


class Generation(Drafting):
    """Drives one request; iterate `run()` for chunks. `stats` is filled as it goes."""

    def __init__(self, req: GenerationRequest, target: TargetClient, drafts: DraftPool | None,
                 tokenizer, eos_token_ids: set[int], draft_timeout_s: float, is_active=lambda: True,
                 reroute=None, max_reroutes: int = 0, target_timeout_s: float | None = None,
                 control=None, observer=None, feature_spec: FeatureSpec | None = None,
                 rate_book: RateBook | None = None, local_drafters: dict | None = None, overlap=None, tables=None,
                 decode_steps: int = 1, lookup: tuple[int, int] | None = None, fresh_tables: bool = True,
                 graft=None):
        self.req, self.target, self.drafts = req, target, drafts
        self.decode_steps = decode_steps  # target steps per Verify call in a burst (_burst)
        self.lookup = lookup  # (min_n, max_n): n-gram rounds burst, the target drafting each step; None: not
        # local_drafters: {method: propose(context, k) -> tokens} run here, with no hop to the draft
        # tier (n-gram: the context is already here); other methods go to the draft tier
        self.local = dict(local_drafters or {})
        # graft(context, k) -> tokens: an n-gram draft added to each block tree (Drafting._graft); None: none
        self.graft, self._grafted = graft, None
        # overlap: an Executor to draft round r+1 on while round r verifies (predraft.py); None: off
        self._guess: int | None = None
        self.predraft = None if overlap is None or drafts is None else Predrafter(
            lambda ctx, n, r, calls, budget_s: self.drafts.propose(self.seq_id, ctx, n, self.method, self.req.params,
                                                                   r, self.draft_timeout_s, calls=calls,
                                                                   budget_s=budget_s), overlap)
        # k per round: fixed, or for goodput (req.k_max > 0) from the target's cost model (a tree: n
        # of its node budget's nodes, rounds.nodes)
        # tables: an Executor for the block drafter's trees from candidate tables drafted during the
        # previous verify (tails.py); None: off
        self.tails = None if tables is None or drafts is None else Tails(tables)
        self._table, self._tail_waited = None, False
        self._key = req.method  # the round policy's key this round (tails: per staleness)
        self.rounds = RoundPolicy(req.k_max, rate_book, control, tree_budget=req.tree_budget,
                                  overlap=self.predraft is not None, fresh_tables=fresh_tables)
        self._predrafted = False  # this round's draft was a pre-draft that hit
        # feature_spec: what to ask the target for when the drafter reads target features (block);
        # None: such drafters get no features (they report misses and rounds run without drafts)
        self.feature_spec = feature_spec
        self.feed: FeatureFeed | None = None
        # control: a SpeculationControl (admin hot switch), read every round; observer(method, drafted,
        # accepted, emitted, draft_s, verify_s) is called after every verify round (metrics)
        self.control, self.observer = control, observer
        self._drafted_any = False
        self.reroute, self.max_reroutes, self.target_timeout_s = reroute, max_reroutes, target_timeout_s
        self.reroutes = 0
        self._tried: list[str] = []
        self.out = OutputAssembler(tokenizer, req.max_tokens, eos_token_ids, tuple(req.stop))
        self.draft_timeout_s = draft_timeout_s
        self.is_active = is_active
        self.stats = SpecStats()
        self.seq_id = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
        self.method, self.k = self._settings()
        self.ttft_s: float | None = None
        self._chose_zero = False  # this round's k = 0 was the round policy's choice
        self._match: list[int] | None = None  # this round's local n-gram draft by match length (Drafting._bucket)

    def _remaining(self) -> float:
        if self.req.deadline is None:
            return 3600.0
        left = self.req.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded("deadline exceeded while generating")
        return left

    def run(self) -> Iterator[Chunk]:
        started = time.monotonic()
        try:
            first = self._prefill_with_failover()
            self.ttft_s = time.monotonic() - started
            yield self._emit([first])
            while not self.out.finish_reason:
                if not self.is_active():
                    raise Cancelled("client went away")
                yield self._emit(self._round())
        finally:
            self._release()

    def _emit(self, tokens: list[int]) -> Chunk:
        ids, text = self.out.add(tokens)
        return Chunk(ids, text, self.out.finish_reason)

    def _wants_features(self) -> bool:
        return self.feature_spec is not None and self.method in FEATURE_DRAFTERS

    def _round(self) -> list[int]:
        draft_s, started = self.stats.draft_time_s, time.monotonic()
        k = self._k_this_round()
        draft = self._draft(k)
        if draft.parents is None and draft.token_ids and draft.accept is None:  # the target may trim it
            draft = dataclasses.replace(draft, accept=self.rounds.accept(self._key, len(draft.token_ids)))
        self._overlap(self.req.prompt_ids + self.out.token_ids, draft)
        t0 = time.monotonic()
        try:
            steps, lookup = self._burst(draft, k)
            burst = {} if steps <= 1 else {"steps": steps} if lookup is None else {"steps": steps, "ngram": lookup}
            if self._wants_features():
                outcome = self.target.verify(self.seq_id, draft, self._call_timeout(), features=self.feature_spec,
                                             **burst)
                self._take_features(outcome.features)
            else:
                outcome = self.target.verify(self.seq_id, draft, self._call_timeout(), **burst)
        except (Unavailable, NotFound, DeadlineExceeded) as exc:
            if not self._may_reroute(exc):
                raise
            return [self._failover(exc)]
        finally:
            self.stats.verify_time_s += time.monotonic() - t0
        self.rounds.take_cost(outcome.cost)
        draft = self._verified(draft, outcome)
        learnt, accepted = self._ungrafted(draft, outcome.accepted, outcome.tokens)
        self.rounds.learn(self._key, learnt, accepted,
                          None if self._predrafted else self.stats.draft_time_s - draft_s, emitted=outcome.tokens)
        self.rounds.observe(self.method, bool(draft.token_ids), time.monotonic() - started, len(outcome.tokens))
        steps = self._record(draft, outcome)
        if self.predraft is not None and not self._tail_mode():  # (tails count in stats directly)
            self._predraft_stats()
        if self.observer is not None:  # per target step (a burst: each its share of the call's time)
            took = (time.monotonic() - t0) / len(steps)
            for i, (drafted, accepted) in enumerate(steps):
                self.observer(self.method, drafted, accepted, accepted + 1,
                              self.stats.draft_time_s - draft_s if i == 0 else 0.0, took)
        return outcome.tokens

    def _verified(self, draft: DraftProposal, outcome) -> DraftProposal:
        """The part of a chain draft the target verified: beside others it may verify a prefix
        (core/trim.py; its first step's drafted count says how much). The rest was not tried:
        no evidence for the acceptance rates."""
        self.stats.trimmed_tokens += outcome.trimmed
        if draft.parents is None and outcome.steps and outcome.steps[0][0] < len(draft.token_ids):
            return draft.head(outcome.steps[0][0])
        return draft

    def _record(self, draft: DraftProposal, outcome) -> list[tuple[int, int]]:
        """Stats of each target step of the call (a burst: several); the steps after the first
        that drafted (the target's prompt lookup) also teach the round policy. [(drafted, accepted)]."""
        if outcome.steps:
            steps = outcome.steps
        elif draft.token_ids:  # a worker that does not report steps: the draft's, then plain ones
            steps = [(len(draft.token_ids), outcome.accepted)] + [(0, 0)] * (len(outcome.tokens) - outcome.accepted - 1)
        else:  # an AR round, maybe a burst: one target step per token
            steps = [(0, 0)] * len(outcome.tokens)
        depth = None if draft.parents is None else max(DraftTree(draft.token_ids, draft.parents, []).depths(), default=0)
        for i, (drafted, accepted) in enumerate(steps):
            self.stats.record(drafted, accepted, accepted + 1, positions=depth if i == 0 else None)
            if i and drafted:  # the target's lookup, keyed by its match (the same lookup here, same tokens)
                ahead = outcome.tokens[:sum(a + 1 for _, a in steps[:i])]
                found = self._match is not None and self._bucket(self.req.prompt_ids + self.out.token_ids + ahead, 0)
                self.rounds.learn(found[0] if found else self.method, DraftProposal([0] * drafted), accepted, None)
        return steps

    # ------------------------------------------------------------------ target failover
    def _call_timeout(self) -> float:
        left = self._remaining()
        return left if self.target_timeout_s is None else min(left, self.target_timeout_s)

    def _may_reroute(self, exc: SpecmeshError) -> bool:
        if self.reroute is None or self.reroutes >= self.max_reroutes:
            return False
        if isinstance(exc, DeadlineExceeded):  # only a capped call, never the request's own deadline
            return self.req.deadline is None or time.monotonic() < self.req.deadline
        return True

    def _prefill(self, context: list[int]) -> int:
        """Prefill context on self.target; with the block drafter, keep the features it returns."""
        left = max(0, self.req.max_tokens - len(self.out.token_ids))  # the worker reserves KV for it
        features = self.feature_spec if self._wants_features() else None
        if features is None and not hasattr(self.target, "prefill_outcome"):  # a plain TargetClient
            return self.target.prefill(self.seq_id, context, self.req.params, self._call_timeout(), max_new_tokens=left)
        out = self.target.prefill_outcome(self.seq_id, context, self.req.params, self._call_timeout(),
                                          features, max_new_tokens=left)
        self.rounds.take_cost(out.cost)
        if out.features is not None:
            self.feed = self.feed or FeatureFeed(self.feature_spec.max_rows or out.features.shape[0])
            self.feed.reset(out.features, len(context))
            self.stats.feature_bytes += feature_nbytes(out.features)
        return out.token

    def _prefill_with_failover(self) -> int:
        try:
            return self._prefill(self.req.prompt_ids)
        except (Unavailable, NotFound, DeadlineExceeded) as exc:
            if not self._may_reroute(exc):
                raise
            return self._failover(exc)

    def _failover(self, exc: SpecmeshError) -> int:
        """Move the sequence to another target: prefill prompt + output so far; the next token."""
        context = self.req.prompt_ids + self.out.token_ids
        while True:
            self.reroutes += 1
            old = self.target
            self._tried.append(getattr(old, "address", repr(old)))
            log.warning("request %s: target %s failed (%s); re-prefilling %d tokens elsewhere (failover %d/%d)",
                        self.req.request_id, self._tried[-1], exc, len(context), self.reroutes, self.max_reroutes)
            self._release_target(old)
            try:
                self.target = self.reroute(tuple(self._tried))
            except SpecmeshError as none_left:
                self.target = old  # nothing else to hold; _release() releases it again, harmlessly
                raise Unavailable(f"target worker failed ({exc}); {none_left}") from exc
            try:
                return self._prefill(context)
            except (Unavailable, NotFound, DeadlineExceeded) as again:
                if self.req.deadline is not None and time.monotonic() >= self.req.deadline:
                    raise
                if not self._may_reroute(again):
                    raise Unavailable(f"target workers failed {self.reroutes} time(s); last: {again}") from again
                exc = again

    def _predraft_stats(self) -> None:
        # every round, not only at release: a stream's last chunk carries the stats before then
        p = self.predraft
        self.stats.predraft_hits, self.stats.predraft_misses, self.stats.draft_wait_s = p.hits, p.misses, p.wait_s

    def _release_target(self, target) -> None:
        try:
            target.release(self.seq_id)
        except SpecmeshError as exc:
            log.info("release of %s on a failed target: %s", self.seq_id, exc)

    def _release(self) -> None:
        if self.tails is not None:
            self.tails.drop()
        if self.predraft is not None and not self._tail_mode():
            self.predraft.drop()
            self._predraft_stats()
        try:
            self.target.release(self.seq_id)
        except SpecmeshError as exc:
            log.warning("release of %s failed: %s (the worker reclaims it when idle)", self.seq_id, exc)
        if self.drafts is not None and self._drafted_any:  # only a draft tier that drafted holds state
            self.drafts.release(self.seq_id)

