"""How a request's round gets its draft (a mixin of coordinator.loop.Generation): drafted where
the context is (n-gram, no hop), from a pre-draft that hit, or by a Propose to the draft tier;
the block drafter's target features sent as the rows the draft tier lacks; the next round's
pre-draft started before this round's Verify. A draft failure never fails the request: the round
runs with k = 0 (the target alone).
"""

from __future__ import annotations

import logging
import time

from specmesh.core.features import FeatureFeed
from specmesh.core.ngram import match_key
from specmesh.config import MAX_DRAFT_TOKENS
from specmesh.core.tree import build_tree, graft_chain
from specmesh.core.treepolicy import path_nodes
from specmesh.core.types import DraftProposal, NgramBurst
from specmesh.errors import DeadlineExceeded, SpecmeshError

log = logging.getLogger(__name__)


class Drafting:
    """Uses the Generation's req, method, k, local, drafts, predraft, tails, feed, feature_spec,
    control, lookup, decode_steps, seq_id, out, stats, rounds, draft_timeout_s, _guess,
    _drafted_any, _remaining and _wants_features; sets method / k / _key / _chose_zero (this
    round's drafter, k, policy key, and whether k = 0 was chosen), _match (the local n-gram's
    draft, looked up before k is chosen and keyed by its match's length; None: not that path),
    _predrafted (this round's draft was a pre-draft that hit) and, with tails, _table /
    _tail_waited (this round's tail, and
    whether the round waited for it) and _grafted (the block tree's own nodes where this round's
    tree carries an n-gram graft, else None); reads graft (the n-gram proposer for grafts)."""

    def _settings(self) -> tuple[str, int]:
        """This round's (drafter, k): the request's own, through the hot switch when there is one."""
        method, k = (self.req.method, self.req.k) if self.control is None \
            else self.control.effective(self.req.method, self.req.k)
        if self.drafts is None and method not in self.local:
            return "off", 0
        return (method, k) if k > 0 else ("off", 0)

    def _k_this_round(self) -> int:
        # a round emits up to k+1 tokens: never draft past max_tokens
        self.method, self.k = self._settings()
        ready, coming = 0, False
        if self.predraft is not None and self.method not in self.local:
            context = self.req.prompt_ids + self.out.token_ids
            ready, coming = self.predraft.ready(context), self.predraft.in_flight(context)
        if self._tail_mode():  # the round policy's key, and the local n-gram's draft where it is keyed by its match
            self._key, self._match = self._tail_key(), None
        else:
            context = self.req.prompt_ids + self.out.token_ids
            self._key, self._match = self._bucket(context, max(self.rounds.k_max, self.k)) or (self.method, None)
        if self._match == []:  # the local n-gram found no earlier copy of the suffix: nothing to draft
            k = 0
        else:
            k = self.rounds.k(self._key, self.k, self.req.max_tokens - len(self.out.token_ids) - 1, ready=ready,
                              coming=coming, paced=self.method not in self.local)
        if k and self.method not in self.local and not self._tier_up():
            k = 0  # no draft worker to ask now: a round of the target alone (a burst), no Propose to fail
            self.stats.tier_down_rounds += 1
        drafted = self.rounds.nodes if k and self.req.tree_budget > 0 else k  # a tree's k: its nodes
        self.stats.chosen_k[drafted] = self.stats.chosen_k.get(drafted, 0) + 1
        self._chose_zero = k == 0
        return k

    def _bucket(self, context: list[int], k: int) -> tuple[str, list[int]] | None:
        """(round policy key, draft) of the local n-gram's lookup under goodput k: the drafter at its
        match's length (ngram.match_key: a long match drafts long, session 41; no match: the
        drafter, no draft); None where that does not apply (another drafter, fixed k, a tree)."""
        matcher = getattr(self.local.get(self.method), "match", None)
        if matcher is None or self.req.k_max <= 0 or self.req.tree_budget > 0:
            return None
        n, toks = matcher(context, k)
        return (match_key(self.method, n) if n else self.method), toks

    def _burst(self, draft, k: int) -> tuple[int, NgramBurst | None]:
        """(target steps this round asks for in one Verify call, the target's prompt lookup for
        them). n-gram drafted here with `lookup` set: decode_steps steps, the first verifying this
        round's draft and each later one a draft the target looks up itself (up to k tokens): one
        hop for several rounds, as HF's in-process prompt lookup pays none. Beside others, a round
        that comes back after one step re-joins the target's batch a hop later, and the batch's next
        step waits for it or leaves it out (one-step n-gram rounds: 0.82-0.95x AR at concurrency
        4-16, session 17, docs/bench/round_policy.md). Otherwise up to decode_steps plain steps while
        speculation is off or in a round the round policy chose k = 0 for (not with pre-drafts,
        which guess the next round's context); a draft tree beside live others too (its tree in
        the first step): a one-step round would come back while the others' bursts go on and
        re-join them a step later, out of step from then on (the block tree at concurrency 4 on a
        Zen 3: 0.85-0.92x AR with one-step drafting rounds, 0.99-1.04x as bursts, three A/B pairs,
        docs/bench/round_policy.md#session-31); else one."""
        if self.decode_steps <= 1:
            return 1, None
        left = max(1, self.req.max_tokens - len(self.out.token_ids))
        if self.lookup is not None and self.method == "ngram" and self.method in self.local:
            by_match = self.rounds.by_match(self.method, left - 1) if self._match is not None else ()
            if by_match:  # each later step drafts as its own match's length pays
                return self.decode_steps, NgramBurst(max(b.k for b in by_match), *self.lookup, max_tokens=left,
                                                     by_match=by_match)
            return self.decode_steps, NgramBurst(self.rounds.in_force(self.method, k), *self.lookup, max_tokens=left,
                                                 rates=self.rounds.rates(self.method))
        predrafting = (self.predraft is not None and self.method not in self.local and self.req.tree_budget <= 0
                       and self._tier_up())
        if self.method == "off" or (self._chose_zero and not draft.token_ids and not predrafting):
            return min(self.decode_steps, left), None
        if draft.parents is not None and self.rounds.beside_others():  # its path may take k of `left`
            return max(1, min(self.decode_steps, left - k)), None
        return 1, None

    def _tier_up(self) -> bool:
        """Whether the draft tier has a worker for this method now (a pool that cannot tell: yes).
        While every worker is down after a failure (GrpcDraftPool: for its retry_after_s), rounds
        run as the target alone's, bursts included, instead of paying a failed Propose and a
        one-step round each; the first round after a worker's retry time asks it again."""
        available = getattr(self.drafts, "available", None)
        return available is None or available(self.method)

    def _draft(self, k: int) -> DraftProposal:
        self._predrafted = False
        if k == 0 or self.method == "off":
            return DraftProposal([], None)
        context = self.req.prompt_ids + self.out.token_ids
        t0 = time.monotonic()
        if self.method in self.local:  # no hop: drafted where the context is
            try:
                toks = self._match if self._match is not None else self.local[self.method](context, k)
                return DraftProposal(list(toks)[:k], None)
            finally:
                self.stats.draft_time_s += time.monotonic() - t0
        self._drafted_any = True
        try:
            timeout = min(self.draft_timeout_s, self._remaining())
            if self._wants_features():
                if self._tail_mode():
                    return self._tree_from_table(context, k, timeout)
                return self._propose_with_features(context, k, timeout)
            return self._remote_chain(context, k, timeout)
        except DeadlineExceeded:
            if self.req.deadline is not None and time.monotonic() >= self.req.deadline:
                raise
            return self._draft_failed("draft timed out")
        except SpecmeshError as exc:
            return self._draft_failed(str(exc))
        finally:
            self.stats.draft_time_s += time.monotonic() - t0

    def _remote_chain(self, context: list[int], k: int, timeout: float) -> DraftProposal:
        """k tokens from the draft tier: a pre-draft that hit, else a Propose now. With overlap the
        drafter drafts k+1 and the last one is kept as the guess of the target's bonus token."""
        draft = self.predraft.take(context, timeout) if self.predraft is not None else None
        self._predrafted = draft is not None
        if draft is None:
            want = k + 1 if self.predraft is not None else k
            draft = self.drafts.propose(self.seq_id, context, want, self.method, self.req.params,
                                        self.stats.rounds, timeout)
        toks = list(draft.token_ids)
        self._guess = toks[k] if self.predraft is not None and len(toks) > k else None
        return DraftProposal(toks[:k], None if draft.probs is None else draft.probs[:k])

    def _overlap(self, context: list[int], draft: DraftProposal) -> None:
        """Before round r's Verify: start drafting round r+1 on the guess that r is accepted in full
        (and, when round r drafted one token more, that the target's own token is that one)."""
        guess, self._guess = self._guess, None
        if self.predraft is None or self.method in self.local or self.method == "off" or draft.parents is not None:
            return
        if not self._tier_up():  # no worker to ask: nothing to pre-draft on
            return
        base = context + list(draft.token_ids) + ([guess] if guess is not None else [])
        budget_s = self.rounds.predraft_budget_s(self.method, len(draft.token_ids) + 1)
        if budget_s:  # in step with live others: as many as are drafted while the target verifies
            self.predraft.start(base, self.rounds.k_max + 1, self.stats.rounds + 1, budget_s)
            return
        # one token more than this round drafted (the next round's k may grow by one), or as many
        # as the draft model drafts during this verify if more; the first of them is the guess of
        # the target's own token when round r did not draft it
        n = len(draft.token_ids) + 1 if guess is not None else len(draft.token_ids) + 2
        n = max(n, self.rounds.predraft_tokens(self.method, len(draft.token_ids) + 1) or 0)
        self.predraft.start(base, n, self.stats.rounds + 1)

    def _propose_with_features(self, context: list[int], k: int, timeout: float) -> DraftProposal:
        """Propose with the rows the draft tier lacks; on a miss, once more with the whole window."""
        if self.feed is None or len(self.feed.window) == 0:
            return DraftProposal([], None)  # switched to the block drafter mid-request: features next round
        for complete in (False, True):
            rows, full = self.feed.outgoing(complete)
            draft = self.drafts.propose(self.seq_id, context, k, self.method, self.req.params, self.stats.rounds,
                                        timeout, features=(rows, full), tree_budget=self.rounds.nodes)
            self.stats.draft_feature_bytes += feature_nbytes(rows)
            if not draft.missing_features:
                self.feed.sent()
                if draft.parents is not None:  # a tree: depth <= k, drawn by the worker
                    return DraftProposal(draft.token_ids, None, draft.parents)
                return DraftProposal(draft.token_ids[:k], None if draft.probs is None else draft.probs[:k])
            if full:
                break
        return self._draft_failed("the draft worker holds no target features for the sequence")

    def _tail_mode(self) -> bool:
        """The block drafter's trees from tables drafted during the previous verify (tails.py)."""
        return self.tails is not None and self.req.tree_budget > 0 and self._wants_features()

    def _tail_key(self) -> str:
        """A round's start with tails: settle the table in flight (started by the last round, which
        drafted) and keep the newest table's tail for this round's tree. -> the round policy's key:
        the drafter's own where there is no tail (a drafting round waits for its own Propose), else
        '<drafter>~1' / '~2' (a tail one / two or more positions stale: learnt apart, as they match
        less often). Alone, a round may pass its tail over for a table at its own anchor
        (RoundPolicy.fresh_beats_tail): then it is keyed, and waits, as one without a tail."""
        anchor = len(self.req.prompt_ids) + len(self.out.token_ids) - 1  # the pending token's position
        waited = self.tails.settle(min(self.draft_timeout_s, self._remaining()))
        self.stats.draft_time_s += waited
        self.stats.draft_wait_s += waited
        got = self.tails.tail(anchor)
        key = self.method if got is None else f"{self.method}~{min(got[0], 2)}"
        if got is not None and got[0] > 0 and self.rounds.fresh_beats_tail(self.method, key):
            got, key = None, self.method  # alone: this round waits for a table at its own anchor
        self._table, self._tail_waited = (None, False) if got is None else (got[1:], waited > 0.002)
        return key

    def _start_table(self, context: list[int]) -> bool:
        """Start the candidate table at context's anchor, with the feature rows the draft tier
        lacks; False when there are none yet (switched to the block drafter mid-request)."""
        if self.feed is None or len(self.feed.window) == 0:
            return False
        rows, full = self.feed.outgoing(False)
        whole, _ = self.feed.outgoing(True)
        self.feed.sent()  # the next table's delta starts here; a failed send is a miss, then the whole window
        method, k, round_ = self.method, self.k, self.stats.rounds
        self.tails.start(len(context) - 1, lambda calls: self._table_propose(context, method, k, round_, (rows, full),
                                                                             whole, calls))
        return True

    def _table_propose(self, context, method, k, round_, feats, whole, calls) -> DraftProposal:
        """On the executor: a candidate table at context's anchor, with the rows the draft tier lacks
        (on a miss, once more with the whole window)."""
        timeout = min(self.draft_timeout_s, self._remaining())
        for rows in (feats, (whole, True)):
            draft = self.drafts.propose(self.seq_id, context, k, method, self.req.params, round_, timeout,
                                        features=rows, tree_budget=self.req.tree_budget, calls=calls, candidates=True)
            self.stats.draft_feature_bytes += feature_nbytes(rows[0])
            if not draft.missing_features or rows[1]:
                return draft
        return draft

    def _tree_from_table(self, context: list[int], k: int, timeout: float) -> DraftProposal:
        """This round's tree (rounds.nodes nodes, depth <= k): from the tail found at the round's
        start, starting the next round's table (drafted while the target verifies this one); else
        (no tail) from a table at this anchor, waited for, which the next round's tail comes from.
        Rounds that draft nothing start no table: at load, where goodput leaves most rounds without
        a draft, the draft tier then stays idle instead of taking CPU from the target (a table
        every round: 0.76x / 0.62x AR at concurrency 4 / 16, docs/bench/round_policy.md#session-21)."""
        if self._table is not None:
            self.stats.predraft_hits += 1
            self.stats.draft_waits += self._tail_waited
            self._start_table(context)
        else:
            if not self._start_table(context):  # no feature rows to send yet: switched to the
                return DraftProposal([], None)  # block drafter mid-request; features next round
            self.stats.predraft_misses += 1
            self.stats.draft_waits += 1
            self.stats.draft_wait_s += self.tails.settle(timeout)
            got = self.tails.tail(len(context) - 1)
            if got is None:
                return self._draft_failed("the draft tier returned no candidate table")
            self._table = got[1:]
        tree = build_tree(*self._table, self.rounds.nodes, max_depth=k)
        return self._graft(context, tree, k)

    def _graft(self, context: list[int], tree, k: int) -> DraftProposal:
        """The round's tree, with the coordinator's n-gram draft (up to k tokens, drafted only on a
        match of coordinator.ngram_graft tokens or more) added as a root path where it leaves the
        tree: one forward verifies both, and the walk takes whichever the target agrees with
        (lossless at any temperature: core/tree.py). Copying text (extraction, edits of code in the
        prompt) gets the n-gram's long accepted runs, other text the drafter's tree."""
        self._grafted = None
        chain = self.graft(context, min(k, MAX_DRAFT_TOKENS - len(tree.tokens))) if self.graft and tree.tokens else []
        if chain:
            grafted, added = graft_chain(tree, chain)
            if added:
                self._grafted, tree = len(tree.tokens), grafted
                self.stats.graft_rounds += 1
        return DraftProposal(tree.tokens, None, tree.parents)

    def _ungrafted(self, draft: DraftProposal, accepted: int, emitted: list[int]) -> tuple[DraftProposal, int]:
        """(the block tree of this round without its graft, the nodes of it the target accepted):
        what the tree policy learns from (a graft's tokens are not the drafter's). The accepted
        nodes past the tree's own path count as the graft's (stats.graft_tokens)."""
        n, self._grafted = self._grafted, None
        if n is None or draft.parents is None:
            return draft, accepted
        base = DraftProposal(draft.token_ids[:n], None, draft.parents[:n])
        own = len(path_nodes(base.parents, base.token_ids, emitted[:accepted]))
        self.stats.graft_tokens += accepted - own
        return base, own

    def _take_features(self, rows) -> None:
        """rows: [n+1, F] features of the slots a verify round committed (before its tokens are emitted)."""
        if rows is None:
            return
        self.feed = self.feed or FeatureFeed(self.feature_spec.max_rows or rows.shape[0])
        committed = len(self.req.prompt_ids) + len(self.out.token_ids) - 1  # context minus the pending token
        self.feed.extend(rows, committed + rows.shape[0])
        self.stats.feature_bytes += feature_nbytes(rows)

    def _draft_failed(self, why: str) -> DraftProposal:
        # a draft failure never fails the request: this round runs with k = 0 (target alone)
        self.stats.draft_failures += 1
        if self.stats.draft_failures == 1:
            log.warning("request %s: draft tier failed (%s); continuing with the target alone",
                        self.req.request_id, why)
        return DraftProposal([], None)


def feature_nbytes(rows) -> int:
    """Bytes of a feature tensor (what it costs on the wire: bf16 = 2 per value); 0 for None."""
    return 0 if rows is None else rows.numel() * rows.element_size()
