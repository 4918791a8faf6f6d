"""The coordinator's goodput k (speculative.k_policy: goodput) against fake tiers that send a
hand-built verify cost model, as a target worker does with every Prefill/Verify response."""

from __future__ import annotations

import dataclasses

from specmesh.core.goodput import RateBook
from specmesh.core.types import DraftProposal, PrefillOutcome, VerifyOutcome
from tests.unit.test_loop import PROMPT, SCRIPT, FakeDrafts, FakeTarget, FakeTokenizer, burst, request

from coordinator.loop import Generation


class CostedTarget(FakeTarget):
    """FakeTarget that also reports a verify cost model: seconds by packed rows."""

    def __init__(self, table: dict[int, float], **kw):
        super().__init__(**kw)
        self.table = table

    def _cost(self):
        return {"rows": list(self.table), "seconds": list(self.table.values()), "mean_batch": 1.0}

    def prefill_outcome(self, seq_id, prompt, params, timeout, features=None, max_new_tokens=0):
        return PrefillOutcome(self.prefill(seq_id, prompt, params, timeout), None, self._cost())

    def verify(self, seq_id, draft, timeout):
        return dataclasses.replace(super().verify(seq_id, draft, timeout), cost=self._cost())


def _run(target, drafts, k_max=6, max_tokens=60, book=None):
    req = dataclasses.replace(request(max_tokens=max_tokens, k=4), k_max=k_max)
    gen = Generation(req, target, drafts, FakeTokenizer(), {99}, 5.0, rate_book=book)
    out = [t for chunk in gen.run() for t in chunk.token_ids]
    assert out == SCRIPT[:max_tokens]  # whatever k is chosen, the output is the target's own
    return gen


def test_cheap_verify_and_a_perfect_drafter_grow_k_to_the_max():
    gen = _run(CostedTarget({1: 1.0, 9: 1.05}), FakeDrafts())
    assert max(gen.stats.chosen_k) == 6 and gen.stats.chosen_k.get(6, 0) >= gen.stats.rounds // 2


def test_costly_verify_and_a_useless_drafter_turn_speculation_off():
    drafts = FakeDrafts(wrong_after=0)  # every draft token wrong
    gen = _run(CostedTarget({1: 1.0, 2: 1.6, 9: 5.0}), drafts)
    assert gen.stats.chosen_k.get(0, 0) >= 0.7 * gen.stats.rounds  # k = 0: no Propose at all
    assert len(drafts.calls) < 0.3 * gen.stats.rounds  # only the probes
    assert gen.stats.accepted_tokens == 0


def test_without_a_cost_model_or_with_explicit_k_the_k_is_fixed():
    gen = _run(FakeTarget(), FakeDrafts())  # the target sends no cost model: fixed k = 4
    assert set(gen.stats.chosen_k) <= {4, 3, 2, 1, 0} and gen.stats.chosen_k.get(4, 0) >= gen.stats.rounds - 1
    req = request(max_tokens=30, k=3)  # k_max 0: the request chose k itself
    gen = Generation(req, CostedTarget({1: 1.0, 9: 1.0}), FakeDrafts(), FakeTokenizer(), {99}, 5.0)
    list(gen.run())
    assert set(gen.stats.chosen_k) <= {3, 2, 1, 0} and gen.stats.chosen_k.get(3, 0) >= gen.stats.rounds - 2


def test_the_rate_book_carries_acceptance_to_the_next_request():
    book = RateBook(alpha=0.5)
    _run(CostedTarget({1: 1.0, 9: 1.05}), FakeDrafts(wrong_after=1), book=book)
    rates = book.seed("ngram", 4)
    assert rates[0] > 0.9 and rates[1] < 0.2  # position 1 always right, position 2 always wrong


def test_a_verify_outcome_carries_the_cost_model():
    out = VerifyOutcome(1, [5, 6], False, None, {"rows": [1], "seconds": [0.1], "mean_batch": 1.0})
    assert out.cost["seconds"] == [0.1]


def test_local_ngram_drafts_without_a_hop_to_the_draft_tier():
    from specmesh.core.ngram import propose_ngram

    script = [5, 6, 7, 8] * 30  # a continuation that copies itself: n-gram drafts it well
    target, drafts = FakeTarget(script=script), FakeDrafts(script=script)
    req = request(max_tokens=40, k=4)
    gen = Generation(req, target, drafts, FakeTokenizer(), {99}, 5.0,
                     local_drafters={"ngram": lambda ctx, k: propose_ngram(ctx, k, 1, 4)})
    out = [t for chunk in gen.run() for t in chunk.token_ids]
    assert out == script[:40]
    assert drafts.calls == [] and drafts.released == []  # no Propose, no Release on the draft tier
    assert gen.stats.accepted_tokens > 20 and gen.stats.drafted_tokens > 0
    nodraft = Generation(request(max_tokens=5, k=4), FakeTarget(), None, FakeTokenizer(), {99}, 5.0,
                         local_drafters={"ngram": lambda ctx, k: propose_ngram(ctx, k, 1, 4)})
    assert nodraft.method == "ngram"  # no draft tier at all: a local drafter still serves


def test_overlap_drafts_the_next_round_during_the_verify_and_stays_lossless():
    """A drafter that takes as long as a verify: with overlap each fully accepted round's successor
    was drafted during its verify (hits); a rejected round's pre-draft is dropped (a miss)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    class SlowDrafts(FakeDrafts):
        def propose(self, *a, **kw):
            time.sleep(0.02)
            return super().propose(*a, **kw)

    with ThreadPoolExecutor(2) as pool:
        perfect = SlowDrafts()
        gen = Generation(request(max_tokens=40, k=3), FakeTarget(verify_sleep=0.02), perfect, FakeTokenizer(),
                         {99}, 5.0, overlap=pool)
        out, hits_at_last_chunk = [], None
        for chunk in gen.run():
            out += chunk.token_ids
            if chunk.finish_reason:  # a stream sends its stats with this chunk, before the release
                hits_at_last_chunk = gen.stats.predraft_hits
        assert out == SCRIPT[:40]
        assert gen.stats.predraft_hits >= gen.stats.rounds - 2 and gen.stats.predraft_misses == 0
        assert hits_at_last_chunk >= gen.stats.predraft_hits - 1
        assert perfect.calls[0]["k"] == 4 and max(c["k"] for c in perfect.calls) == 4  # k + 1: the bonus guess
        assert gen.stats.draft_wait_s < 0.02 * gen.stats.rounds  # drafts arrive while the target works

        wrong = SlowDrafts(wrong_after=2)  # two right, then wrong: never accepted in full
        gen = Generation(request(max_tokens=30, k=3), FakeTarget(), wrong, FakeTokenizer(), {99}, 5.0,
                         overlap=pool)
        assert [t for chunk in gen.run() for t in chunk.token_ids] == SCRIPT[:30]
        assert gen.stats.predraft_hits == 0 and gen.stats.predraft_misses >= gen.stats.rounds - 1


def test_a_predraft_hits_when_the_context_extends_its_base_by_its_own_tokens():
    """The prefix rule: a pre-draft after base G serves any context G + t_1..t_m (its own first
    tokens) with t_{m+1}..; a context that leaves G, or names another token, is a miss."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    from coordinator.predraft import Predrafter
    from specmesh.core.types import DraftProposal

    def propose(ctx, n, round_, calls, budget_s):
        return DraftProposal([100 + len(ctx) + i for i in range(n)], torch.eye(8)[:n])

    with ThreadPoolExecutor(1) as pool:
        p = Predrafter(propose, pool)
        p.start([1, 2], 4, 1)  # t = 102, 103, 104, 105
        got = p.take([1, 2, 102], timeout=5)  # the target's token was the drafter's first
        assert got.token_ids == [103, 104, 105] and torch.equal(got.probs, torch.eye(8)[1:4])
        p.start([1, 2], 4, 2)
        assert p.take([1, 2], timeout=5).token_ids == [102, 103, 104, 105]  # exactly the base: all
        for ctx in ([1, 2, 7], [1, 3, 102], [1], [1, 2, 102, 103, 104, 105]):  # another token / base / none left
            p.start([1, 2], 4, 3)
            assert p.take(ctx, timeout=5) is None, ctx
        assert (p.hits, p.misses) == (2, 4)


def test_a_round_without_a_draft_keeps_a_predraft_in_flight_from_its_own_context():
    """A round that did not wait for a pre-draft still drafting from exactly its context (it may
    hit) pre-drafts from that same base: the one in flight is kept, not cancelled and redrafted."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from coordinator.predraft import Predrafter
    from specmesh.core.types import DraftProposal

    release, calls = threading.Event(), []

    def propose(ctx, n, round_, rpcs, budget_s):
        calls.append(list(ctx))
        release.wait(5)
        return DraftProposal([100 + len(ctx) + i for i in range(n)], None)

    with ThreadPoolExecutor(2) as pool:
        p = Predrafter(propose, pool)
        p.start([1, 2], 3, 1)
        assert p.in_flight([1, 2]) and p.in_flight([1, 2, 102]) and not p.in_flight([1, 3])
        assert p.ready([1, 2]) == 0  # still drafting
        p.start([1, 2], 3, 2)  # a k = 0 round at context [1, 2]: the same base
        release.set()
        assert p.take([1, 2, 102], timeout=5).token_ids == [103, 104]
        assert calls == [[1, 2]] and (p.hits, p.misses) == (1, 0)
        assert not p.in_flight([1, 2, 102])  # nothing pending after a take


def test_rounds_without_drafts_predraft_and_a_draft_made_during_the_verify_is_used():
    """A drafter 5x slower than a verify step: waited for, a draft never pays (k = 0). With
    overlap a k = 0 round still asks the draft tier for the target's next token and one more, while
    the target works; when the target's token is the drafter's, that draft is ready at no wait and
    the next round verifies it (a draft made in parallel costs only its verify rows)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    class SlowDrafts(FakeDrafts):
        def propose(self, *a, **kw):
            time.sleep(0.05)
            return super().propose(*a, **kw)

    table = {1: 0.01, 2: 0.0102, 3: 0.0104, 5: 0.0108, 9: 0.0116}
    with ThreadPoolExecutor(2) as pool:
        runs = {}
        for overlap in (None, pool):
            req = dataclasses.replace(request(max_tokens=40, k=4), k_max=4)
            book = RateBook()
            book._rates["ngram"] = [0.0] * 4  # the mesh believes this drafter never fits: k = 0 until a probe
            gen = Generation(req, CostedTarget(table, verify_sleep=0.08), SlowDrafts(), FakeTokenizer(), {99}, 5.0,
                             rate_book=book, overlap=overlap)
            assert [t for chunk in gen.run() for t in chunk.token_ids] == SCRIPT[:40]
            runs[overlap is not None] = gen.stats
        assert runs[False].accepted_tokens <= 8  # waited for: probes only
        assert runs[True].chosen_k.get(0, 0) >= 1 and runs[True].predraft_hits >= 5
        assert runs[True].accepted_tokens >= 15, runs[True]



class CostedBurstTarget(CostedTarget):
    """CostedTarget that decodes `steps` steps of its script per call: a chain draft, if any, in
    the first, then one token a step. live: the sequences it says it holds (others beside ours)."""

    def __init__(self, table, live: int = 0, **kw):
        super().__init__(table, **kw)
        self.live = live
        self.steps: list[tuple[int, int]] = []  # (draft length, steps) per call

    def _cost(self):
        return {**super()._cost(), "live": self.live}

    def verify(self, seq_id, draft, timeout, steps=1):
        self.steps.append((len(draft.token_ids), steps))
        return burst(lambda d: super(CostedBurstTarget, self).verify(seq_id, d, timeout), draft, steps)[0]


def test_rounds_the_policy_switched_off_decode_in_bursts_trees_and_chains():
    """k = 0 by the goodput rule: a tree's round (all or nothing) and a chain's ask for
    decode_steps tokens as AR does; alone, a drafted round is one step."""
    costly = {1: 1.0, 2: 1.6, 9: 5.0}
    tree, chain = CostedBurstTarget(costly), CostedBurstTarget(costly)
    for target, budget in ((tree, 8), (chain, 0)):
        req = dataclasses.replace(request(max_tokens=60, k=4), k_max=6, tree_budget=budget)
        gen = Generation(req, target, FakeDrafts(wrong_after=0), FakeTokenizer(), {99}, 5.0, decode_steps=4)
        assert [t for chunk in gen.run() for t in chunk.token_ids] == SCRIPT[:60]
        assert all(s == 1 for n, s in target.steps if n > 0)  # the probes' drafts: one step
        bursts = [s for n, s in target.steps if n == 0 and s > 1]
        assert bursts and sum(bursts) >= 0.6 * 59  # most of the request's tokens came in bursts


class LookupTarget(CostedBurstTarget):
    """CostedBurstTarget that drafts each burst step after the first by prompt lookup over the
    sequence's tokens, as a target worker does with VerifyRequest.ngram_burst."""

    def __init__(self, table, **kw):
        super().__init__(table, **kw)
        self.lookups: list = []

    def verify(self, seq_id, draft, timeout, steps=1, ngram=None):
        from specmesh.core.ngram import lookup_ngram

        self.steps.append((len(draft.token_ids), steps))
        self.lookups.append(ngram)
        out = CostedTarget.verify(self, seq_id, draft, timeout)
        done = [(len(draft.token_ids), out.accepted)]
        while len(done) < steps and (ngram is None or len(out.tokens) < ngram.max_tokens):
            context = PROMPT + SCRIPT[:self.emitted[seq_id]]
            cap = 0 if ngram is None else min(ngram.k, ngram.max_tokens - len(out.tokens) - 1)
            n, toks = lookup_ngram(context, cap, ngram.min_n, ngram.max_n) if cap > 0 else (0, [])
            more = CostedTarget.verify(self, seq_id, DraftProposal(toks[:ngram.for_match(n)[0]] if toks else []),
                                       timeout)
            done.append((len(self.verifies[-1][1]), more.accepted))
            out = dataclasses.replace(out, tokens=out.tokens + more.tokens)
        return dataclasses.replace(out, steps=done)


def test_ngram_rounds_burst_with_the_targets_prompt_lookup():
    """With lookup set, an n-gram round asks for decode_steps steps with the round's k for the
    target's lookups and at most the tokens left; the output is the target's, the stats count
    every step's drafts, and far fewer calls than tokens are made."""
    target = LookupTarget({1: 1.0, 2: 1.0, 9: 1.05})
    req = dataclasses.replace(request(max_tokens=60, k=4, method="ngram"), k_max=4)
    gen = Generation(req, target, None, FakeTokenizer(), {99}, 5.0, decode_steps=4, lookup=(1, 3),
                     local_drafters={"ngram": lambda context, k: []})  # only the target's lookups draft
    assert [t for chunk in gen.run() for t in chunk.token_ids] == SCRIPT[:60]
    assert all(s == 4 for _, s in target.steps) and all(g.min_n == 1 and g.max_n == 3 for g in target.lookups)
    assert max(g.max_tokens for g in target.lookups) == 59 and len(target.steps) < 59 / 4
    drafted = sum(len(d) for _, d, _ in target.verifies)
    assert drafted > 20 and gen.stats.drafted_tokens == drafted and gen.stats.emitted_tokens == 59


class SlowDraftTarget(CostedTarget):
    """Claims a cheap verify (so goodput drafts) but a round with drafts takes 30 ms of wall time
    and one without 1 ms: what a hop, a coordinator's work or a CPU shared with the draft tier do."""

    def verify(self, seq_id, draft, timeout):
        import time

        time.sleep(0.03 if draft.token_ids else 0.001)
        return super().verify(seq_id, draft, timeout)


def test_rounds_that_emit_slower_than_the_target_alone_are_turned_off_by_their_measured_pace():
    from specmesh.core.pace import PaceBook

    def run(target):
        book = RateBook()
        book.pace = PaceBook(min_rounds=1, every=4)
        drafts = FakeDrafts()
        return _run(target, drafts, max_tokens=150, book=book), book.pace.snapshot()["ngram"], drafts

    gen, pace, drafts = run(SlowDraftTarget({1: 1.0, 9: 1.05}))  # output checked: the target's
    assert pace["draft"][0] > pace["alone"][0] > 0  # ms a token: each round's wall time / its tokens
    assert gen.stats.chosen_k.get(0, 0) >= gen.stats.rounds // 3  # gated to k = 0, but for the probes
    assert 0 < len(drafts.calls) < gen.stats.rounds * 2 / 3  # the probes still ask the draft tier
    fair, pace, _ = run(CostedTarget({1: 1.0, 9: 1.05}))  # drafting as fast as it claims: it keeps drafting
    assert pace["draft"][0] < pace["alone"][0] and fair.stats.chosen_k.get(0, 0) <= 2


class TrimmingTarget(CostedTarget):
    """A target that verifies only each chain's first draft beside others (core/trim.py) and says so."""

    def __init__(self, table, **kw):
        super().__init__(table, **kw)
        self.accepts: list[list[float] | None] = []

    def verify(self, seq_id, draft, timeout):
        self.accepts.append(draft.accept)
        cut = max(0, len(draft.token_ids) - 1)
        out = super().verify(seq_id, draft.head(min(1, len(draft.token_ids))), timeout)
        return dataclasses.replace(out, steps=[(len(draft.token_ids) - cut, out.accepted)], trimmed=cut)


def test_a_trimmed_draft_teaches_only_its_verified_positions():
    book = RateBook(alpha=0.5)
    target = TrimmingTarget({1: 1.0, 9: 1.05})
    gen = _run(target, FakeDrafts(wrong_after=1), book=book)  # position 2 would always be wrong
    sent = [a for a in target.accepts if a]
    assert sent and all(a == sorted(a, reverse=True) and 0 <= a[-1] <= a[0] <= 1 for a in sent)  # p_i sent
    assert gen.stats.trimmed_tokens == sum(len(a) - 1 for a in sent) > 0
    assert gen.stats.drafted_tokens == len(sent)  # one verified draft per drafting round
    rates = book.seed("ngram", 4)
    assert rates[0] > 0.9 and rates[1] == 0.5  # position 2 never verified: its seed stands, not 0


def test_local_ngram_rounds_choose_k_by_the_length_of_their_match():
    """The n-gram looked up here (NgramLookup) under goodput: a round's k is goodput's at its
    match's bucket (ngram~m1 .. ngram~m8, each its own rates), and the burst's later steps draft by
    their own match's (NgramBurst.by_match). On a script that repeats, the matches grow long and
    so do the drafts; the output is the target's own and the book learns per bucket."""
    from specmesh.core.ngram import NgramLookup

    target, book = LookupTarget({1: 1.0, 2: 1.02, 9: 1.1}), RateBook()
    req = dataclasses.replace(request(max_tokens=120, k=4, method="ngram"), k_max=8)
    gen = Generation(req, target, None, FakeTokenizer(), {99}, 5.0, decode_steps=4, lookup=(1, 8), rate_book=book,
                     local_drafters={"ngram": NgramLookup(1, 8)})
    assert [t for chunk in gen.run() for t in chunk.token_ids] == SCRIPT[:120]
    assert "ngram~m8" in gen.rounds.policies and "ngram~m8" in book.snapshot() and "ngram" not in book.snapshot()
    bursts = [g for g in target.lookups if g is not None]
    assert bursts and all([b.min_match for b in g.by_match] == [1, 2, 3, 4, 8] for g in bursts)
    assert all(g.k == max(b.k for b in g.by_match) for g in bursts)
    assert {b.min_match: b.k for b in bursts[-1].by_match}[8] >= 6
    assert max(len(d) for _, d, _ in target.verifies) >= 6  # long matches drafted long
    assert gen.stats.accepted_tokens >= 60 and len(target.steps) < 119 / 4


def test_a_round_without_a_match_asks_no_k_and_drafts_nothing():
    """No earlier copy of the context's suffix: k = 0 without consulting the policy, and the burst
    still carries every bucket's k for its later steps."""
    from specmesh.core.ngram import NgramLookup

    target = LookupTarget({1: 1.0, 2: 1.02, 9: 1.1})
    req = dataclasses.replace(request(max_tokens=8, k=4, method="ngram"), k_max=8)
    gen = Generation(dataclasses.replace(req, prompt_ids=[90, 91]), target, None, FakeTokenizer(), {99}, 5.0,
                     decode_steps=4, lookup=(1, 8), local_drafters={"ngram": NgramLookup(1, 8)})
    list(gen.run())
    assert target.steps[0][0] == 0 and gen.stats.chosen_k.get(0, 0) >= 1 and not gen.rounds.policies.get("ngram")
