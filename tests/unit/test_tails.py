"""The block drafter overlapped with verification through candidate tables (coordinator/tails.py):
each round drafts its tree from the rows of the table made during the previous verify that reach
past this round's anchor, and starts the next table; the draft worker answers a table for every
block position (ProposeRequest.candidates) from the same forward it drafts trees from."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from coordinator.loop import Generation
from coordinator.tails import Tails
from specmesh.core.tree import build_tree, walk_tree
from specmesh.core.types import DraftProposal, FeatureSpec, GenerationRequest, PrefillOutcome, SamplingParams, VerifyOutcome
from specmesh.errors import InvalidArgument, Unavailable
from specmesh.rpc.convert import candidates_from_pb, candidates_to_pb
from tests.unit.test_block_worker import W, drafter, held_window, job, rows  # noqa: F401 - drafter: a fixture
from tests.unit.test_loop import burst

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
SCRIPT = [(i % 20) + 10 for i in range(100)]
DEPTH = 7  # a block of 8: 7 draft positions per table


class TreeTarget:
    """Greedy continuation SCRIPT; walks a draft tree (or a chain) by it; feature rows = positions."""

    def __init__(self):
        self.emitted = 0

    def prefill_outcome(self, seq_id, prompt, params, timeout, features=None, max_new_tokens=0):
        self.emitted = 1
        return PrefillOutcome(SCRIPT[0], rows(max(0, len(prompt) - W), len(prompt)))

    def verify(self, seq_id, draft, timeout, features=None):
        p = self.emitted
        parents = draft.parents if draft.parents is not None else list(range(-1, len(draft.token_ids) - 1))
        depth = [0]
        for q in parents:
            depth.append(depth[q + 1] + 1)
        path, emitted = walk_tree(draft.token_ids, parents, lambda j: SCRIPT[p + depth[j]])
        committed = len(PROMPT) + p - 1
        self.emitted = p + len(emitted)
        return VerifyOutcome(len(path) - 1, emitted, False, rows(committed, committed + len(emitted)))

    def release(self, seq_id):
        pass


class TableDrafts:
    """A draft tier answering candidate tables: at anchor a, row d holds SCRIPT's token for
    position a + 1 + d first and a wrong one second; checks the feature rows it is sent."""

    def __init__(self, fail: bool = False, fail_after: int | None = None):
        self.window, self.fail, self.fail_after, self.calls = None, fail, fail_after, []

    def propose(self, seq_id, context, k, method, params, round_, timeout, features=None, tree_budget=0,
                calls=None, candidates=False):
        self.calls.append((len(context), features[1], candidates))
        if self.fail or (self.fail_after is not None and len(self.calls) > self.fail_after):
            raise Unavailable("draft tier down")
        self.window = held_window(self.window, features, context)
        if self.window is None:
            return DraftProposal([], None, missing_features=True)
        p = len(context) - len(PROMPT)  # SCRIPT[p] is position end + 1's token
        right = torch.tensor(SCRIPT[p:p + DEPTH])
        table = torch.stack([right, right + 50], dim=1)  # [D, 2]: the right token, then a wrong one
        logq = torch.tensor([[-0.1, -2.0]]).expand(DEPTH, 2)
        return DraftProposal([], None, candidates=(logq, table))

    def release(self, seq_id):
        pass


def generate(drafts, k: int = 2, max_tokens: int = 30, skip=lambda round_: False):
    """skip(round) -> True: the round policy chooses k = 0 for that round."""
    req = GenerationRequest(list(PROMPT), max_tokens, SamplingParams(), "block", k, request_id="r", tree_budget=4)
    with ThreadPoolExecutor(2) as pool:
        gen = Generation(req, TreeTarget(), drafts, type("Tok", (), {"decode": lambda self, ids, **kw: ""})(), {99},
                         5.0, feature_spec=FeatureSpec((0, 1), W), tables=pool)
        choose = gen.rounds.k
        gen.rounds.k = lambda *a, **kw: 0 if skip(gen.stats.rounds) else choose(*a, **kw)
        list(gen.run())
    return gen


def test_rounds_draft_from_the_previous_tables_tail_at_the_right_offset():
    gen = generate(TableDrafts())
    assert gen.out.token_ids == SCRIPT[:30]
    s = gen.stats
    # the first round after the prefill has no tail and waits for its own table; every later one
    # drafts from the tail of the table made during the previous verify
    assert s.predraft_misses == 1 and s.predraft_hits == s.rounds - 1 and s.draft_waits >= 1
    # every tree accepted its full depth: the tail's rows were the anchor's positions (a row off
    # would put the right token one depth early or late: the tree's path would miss it)
    assert s.accepted_per_position == s.drafted_per_position and s.accepted_tokens > s.rounds
    assert s.draft_failures == 0


def test_every_round_starts_one_table_with_the_rows_committed_since_the_last():
    drafts = TableDrafts()
    gen = generate(drafts)
    assert all(c for _, _, c in drafts.calls)  # candidate tables only
    assert drafts.calls[0][1] is True  # the prefill's window, whole
    assert not any(complete for _, complete, _ in drafts.calls[1:])  # then deltas only (checked by the tier)
    # one table per round; the last round's is dropped at the end, before the executor ran it
    # when the request ends first (seen under load: 10 rounds, 9 calls); anchors strictly grow
    assert gen.stats.rounds - 1 <= len(drafts.calls) <= gen.stats.rounds + 1
    assert [n for n, _, _ in drafts.calls] == sorted({n for n, _, _ in drafts.calls})


def test_a_failed_draft_tier_leaves_the_target_alone_and_the_output_exact():
    gen = generate(TableDrafts(fail=True))
    assert gen.out.token_ids == SCRIPT[:30]
    assert gen.stats.accepted_tokens == 0 and gen.stats.draft_failures >= 1


def test_a_draft_tier_dying_mid_request_uses_the_last_table_then_runs_the_target_alone():
    gen = generate(TableDrafts(fail_after=3), max_tokens=40)
    assert gen.out.token_ids == SCRIPT[:40]
    s = gen.stats
    assert s.accepted_tokens > 0 and s.draft_failures >= 1  # drafted while it lived, then k = 0 rounds
    assert s.rounds > 40 // 3  # after the death most rounds emitted one token


class BurstTreeTarget(TreeTarget):
    """TreeTarget that sends a cheap verify cost model with `live` sequences in its forwards and
    decodes `steps` steps a call (the draft, if any, in the first), as a target worker's burst."""

    def __init__(self, live: int):
        super().__init__()
        self.live, self.calls = live, []  # calls: (draft nodes, steps) per Verify

    def _cost(self):
        return {"rows": [1, 9, 17], "seconds": [1.0, 1.02, 1.04], "mean_batch": 1.0, "live": self.live}

    def prefill_outcome(self, *a, **kw):
        return replace(super().prefill_outcome(*a, **kw), cost=self._cost())

    def verify(self, seq_id, draft, timeout, features=None, steps=1):
        self.calls.append((len(draft.token_ids), steps))
        out, done = burst(lambda d: super(BurstTreeTarget, self).verify(seq_id, d, timeout, features), draft, steps)
        return replace(out, steps=done, cost=self._cost())


def _burst_generate(live: int, max_tokens: int) -> tuple[Generation, BurstTreeTarget]:
    target = BurstTreeTarget(live)
    req = GenerationRequest(list(PROMPT), max_tokens, SamplingParams(), "block", 2, request_id="r", tree_budget=4,
                            k_max=4)
    with ThreadPoolExecutor(2) as pool:
        gen = Generation(req, target, TableDrafts(), type("Tok", (), {"decode": lambda self, ids, **kw: ""})(), {99},
                         5.0, feature_spec=FeatureSpec((0, 1), W), tables=pool, decode_steps=4)
        list(gen.run())
    return gen, target


@pytest.mark.parametrize("live", [4, 0])
def test_beside_live_others_a_tree_round_is_a_burst_and_its_tables_stay_aligned(live):
    """With others live in the target's forwards, a round that drafts its tree asks for the
    decode_steps steps of a plain round (the tree in the first) and keeps in step with their
    bursts; the next round's tail is then several positions past its table's anchor and still
    drafts the right tokens (every tree accepted to its depth). Alone, a tree round is one step."""
    gen, target = _burst_generate(live, 40)
    assert gen.out.token_ids == SCRIPT[:40]
    drafting = [steps for nodes, steps in target.calls if nodes]
    assert len(drafting) >= 3 and gen.stats.accepted_tokens >= len(drafting)
    assert max(drafting) == (4 if live else 1) and (not live or all(s == 4 for s in drafting[:-1]))
    s = gen.stats
    assert s.accepted_per_position == s.drafted_per_position and s.draft_failures == 0


def test_a_tree_burst_never_runs_past_max_tokens():
    """A tree's accepted path counts in its burst: its steps leave room for the whole depth, so
    the target never decodes past max_tokens, whatever the request's length."""
    for max_tokens in range(20, 36):
        gen, target = _burst_generate(4, max_tokens)
        assert gen.out.token_ids == SCRIPT[:max_tokens]
        assert target.emitted == max_tokens, max_tokens


def test_tails_offsets_and_drop():
    pool = ThreadPoolExecutor(1)
    tails = Tails(pool)
    logq, toks = torch.zeros(DEPTH, 2), torch.arange(DEPTH * 2).view(DEPTH, 2)
    tails.start(10, lambda calls: DraftProposal([], None, candidates=(logq, toks)))
    assert tails.pending_at(10) and tails.tail(10) is None  # not settled yet
    assert tails.settle(1.0) >= 0 and not tails.pending_at(10)
    off, lq, tk = tails.tail(13)
    assert off == 3 and torch.equal(tk, toks[3:]) and lq.shape == (DEPTH - 3, 2)
    assert tails.tail(10 + DEPTH) is None and tails.tail(9) is None  # past the table / before it

    class Call:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    call = Call()
    started = ThreadPoolExecutor(1)
    blocker = started.submit(lambda: __import__("time").sleep(0.2))
    tails2 = Tails(started)
    tails2.start(5, lambda calls: calls.append(call) or DraftProposal([]))
    tails2.drop()  # queued behind the blocker: never runs
    blocker.result()
    started.shutdown(wait=True)
    assert not tails2.pending_at(5)
    pool.shutdown()


def test_the_worker_answers_every_positions_candidates_the_tree_is_built_from(drafter):  # noqa: F811
    tree = drafter.propose(job("t", 9, rows(2, 8), complete=True, k=4, tree=6))
    table = drafter.propose(replace(job("u", 9, rows(2, 8), complete=True, k=1, tree=6), candidates=True))
    logq, toks = table.candidates
    assert table.token_ids == [] and logq.shape == toks.shape == (4, 6)  # block of 5: 4 positions, width 6
    assert (logq[:, 1:] <= logq[:, :-1]).all()
    again = build_tree(logq, toks, 6)
    assert again.tokens == tree.token_ids and again.parents == tree.parents


def test_candidates_travel_and_are_checked():
    logq = torch.tensor([[-0.1, -2.0], [-0.5, -0.7]])
    toks = torch.tensor([[3, 4], [5, 6]])
    back = candidates_from_pb(candidates_to_pb((logq, toks)), vocab_size=10)
    assert torch.equal(back[1], toks) and torch.allclose(back[0], logq)
    assert candidates_to_pb(None) is None
    bad = candidates_to_pb((logq, toks))
    bad.token_ids[0] = 12
    with pytest.raises(InvalidArgument):
        candidates_from_pb(bad, vocab_size=10)
    unsorted = candidates_to_pb((logq.flip(-1), toks))
    with pytest.raises(InvalidArgument):
        candidates_from_pb(unsorted)
    short = candidates_to_pb((logq, toks))
    short.depth = 3
    with pytest.raises(InvalidArgument):
        candidates_from_pb(short)


def test_rounds_that_draft_nothing_start_no_table():
    """At load goodput leaves most rounds without a draft; a table each round kept the draft tier
    busy on the target's CPU (0.62x AR at concurrency 16 on 2 cores): only drafting rounds start one."""
    drafts = TableDrafts()
    gen = generate(drafts, skip=lambda r: r % 3 != 0)  # drafts in every third round
    assert gen.out.token_ids == SCRIPT[:30]
    drafting = sum(v for n, v in gen.stats.chosen_k.items() if n)
    assert len(drafts.calls) == drafting < gen.stats.rounds
    # a round after two without a draft still finds a tail (the table is 3+ positions back)
    assert gen.stats.predraft_hits >= drafting - 1


def test_the_staleness_bench_walks_a_tree_by_depth():
    from specmesh.bench.staleness import accepted

    logq = torch.tensor([[-0.1, -2.0], [-0.2, -1.0], [-0.3, -3.0]])
    toks = torch.tensor([[5, 6], [7, 8], [9, 4]])
    tree = build_tree(logq, toks, 5)  # best-first: 5; 7 and 8 under it; 9 under each (6 scores too low)
    assert (tree.tokens, tree.parents) == ([5, 7, 9, 8, 9], [-1, 0, 1, 0, 3])
    assert accepted(tree, [5, 7, 9]) == 3
    assert accepted(tree, [5, 8, 9]) == 3  # the second-ranked branch at depth 2
    assert accepted(tree, [5, 8, 1]) == 2
    assert accepted(tree, [6, 7, 9]) == 0
    assert accepted(tree, [1, 7, 9]) == 0


def test_the_staleness_bench_merges_an_ngram_chain_into_a_tree():
    from specmesh.bench.staleness import accepted, merged

    logq = torch.tensor([[-0.1, -2.0], [-0.2, -1.0], [-0.3, -3.0]])
    toks = torch.tensor([[5, 6], [7, 8], [9, 4]])
    tree = build_tree(logq, toks, 5)  # [5, 7, 9, 8, 9] under [-1, 0, 1, 0, 3]
    both = merged(tree, [5, 8, 3, 2])  # shares 5 and 8, then 3 under 8 and 2 under 3
    assert (both.tokens, both.parents) == ([5, 7, 9, 8, 9, 3, 2], [-1, 0, 1, 0, 3, 3, 5])
    assert both.scores[:5] == tree.scores and both.scores[5:] == [float("-inf")] * 2
    assert accepted(both, [5, 8, 3, 2, 1]) == 4  # the chain's path, past the tree
    assert accepted(both, [5, 7, 9, 1]) == 3  # the tree's own path is untouched
    assert accepted(merged(tree, [6, 1]), [6, 1, 0]) == 2  # a chain no tree node starts: a new root branch
    assert merged(tree, []) == tree and merged(tree, [5, 7, 9]) == tree  # nothing new: the tree as it was


def test_alone_a_round_waits_for_a_fresh_table_only_where_that_emits_faster():
    from coordinator.roundpolicy import RoundPolicy
    from specmesh.core.treepolicy import TreePolicy

    def policy(live: int = 1, wait: float | None = 0.004) -> RoundPolicy:
        rp = RoundPolicy(k_max=7, tree_budget=8)
        rp.take_cost({"rows": [1, 9], "seconds": [0.030, 0.033], "mean_batch": 1.0, "live": live})
        # offline-like tokens per round by budget 1..8: fresh tables beat one-position-stale tails
        rp.policies["block"] = TreePolicy(8, seed=[1.33, 1.48, 1.56, 1.64, 1.69, 1.73, 1.76, 1.79])
        rp.policies["block~1"] = TreePolicy(8, seed=[1.21, 1.31, 1.37, 1.41, 1.45, 1.48, 1.51, 1.53])
        if wait is not None:
            rp.draft_s["block"] = wait
        return rp

    assert policy().fresh_beats_tail("block", "block~1")  # 1.79 / 37 ms against 1.53 / 33 ms
    assert not policy(wait=0.020).fresh_beats_tail("block", "block~1")  # the table costs more than it buys
    assert not policy(wait=None).fresh_beats_tail("block", "block~1")  # no wait measured yet
    assert not policy(live=3).fresh_beats_tail("block", "block~1")  # beside others: never a wait
    off = policy()
    off.fresh_tables = False  # coordinator.fresh_tables: false
    assert not off.fresh_beats_tail("block", "block~1")


class CostedTreeTarget(TreeTarget):
    """TreeTarget sending a verify cost model (goodput on): 9 rows cost 1.1x one."""

    COST = {"rows": [1, 9], "seconds": [0.030, 0.033], "mean_batch": 1.0}

    def prefill_outcome(self, *a, **kw):
        return replace(super().prefill_outcome(*a, **kw), cost=self.COST)

    def verify(self, *a, **kw):
        return replace(super().verify(*a, **kw), cost=self.COST)


class FirstRowDrafts(TableDrafts):
    """Tables whose first row alone is right: a fresh table's tree accepts a draft, a stale tail none."""

    def propose(self, *a, **kw):
        d = super().propose(*a, **kw)
        if d.candidates is None:
            return d
        logq, table = d.candidates
        wrong = table.clone()
        wrong[1:] += 100
        return DraftProposal([], None, candidates=(logq, wrong))


@pytest.mark.parametrize("fresh", [True, False])
def test_alone_rounds_wait_for_a_fresh_table_where_stale_tails_miss(fresh):
    req = GenerationRequest(list(PROMPT), 40, SamplingParams(), "block", 2, request_id="r", tree_budget=4, k_max=7)
    with ThreadPoolExecutor(2) as pool:
        gen = Generation(req, CostedTreeTarget(), FirstRowDrafts(), type("Tok", (), {"decode": lambda self, ids, **kw: ""})(),
                         {99}, 5.0, feature_spec=FeatureSpec((0, 1), W), tables=pool, fresh_tables=fresh)
        list(gen.run())
    assert gen.out.token_ids == SCRIPT[:40]  # lossless whichever table a round drafts from
    s = gen.stats
    if fresh:  # once the tails are seen to miss, rounds wait for a table at their own anchor and accept
        assert s.predraft_misses > s.predraft_hits and s.accepted_tokens >= s.predraft_misses - 1
    else:  # coordinator.fresh_tables: false: only the first round waits
        assert s.predraft_misses == 1
