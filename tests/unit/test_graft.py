"""An n-gram draft grafted onto the block drafter's tree (coordinator.ngram_graft): one forward
verifies both; the walk keeps the target's law (core/tree.py); the tree policy learns from the
drafter's own nodes only."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from coordinator.loop import Generation
from specmesh.core.ngram import propose_ngram
from specmesh.core.tree import DraftTree, build_tree, graft_chain, verify_tree, walk_tree
from specmesh.core.treepolicy import TreePolicy
from specmesh.core.types import DraftProposal, FeatureSpec, GenerationRequest, SamplingParams
from tests.unit.test_block_worker import W
from tests.unit.test_tails import PROMPT, SCRIPT, TableDrafts, TreeTarget


def _tree() -> DraftTree:
    # root children 5, 6; 5 -> 7; 7 -> 8
    return DraftTree([5, 6, 7, 8], [-1, -1, 0, 2], [-0.1, -0.5, -0.2, -0.3])


def test_a_chain_on_the_tree_adds_nothing():
    grafted, added = graft_chain(_tree(), [5, 7, 8])
    assert added == 0 and grafted.tokens == _tree().tokens and grafted.parents == _tree().parents


def test_a_chain_leaving_the_tree_hangs_below_where_it_left():
    tree = _tree()
    grafted, added = graft_chain(tree, [5, 7, 9, 10])
    assert added == 2
    n = len(tree.tokens)
    assert grafted.tokens[:n] == tree.tokens and grafted.parents[:n] == tree.parents  # the tree unchanged
    assert grafted.tokens[n:] == [9, 10] and grafted.parents[n:] == [2, n]  # below node '7', then a chain
    assert grafted.depths() == [1, 1, 2, 3, 3, 4]


def test_a_chain_off_at_the_root_is_a_new_root_child_and_siblings_stay_distinct():
    grafted, added = graft_chain(_tree(), [11, 5, 5])
    assert added == 3 and grafted.parents[4:] == [-1, 4, 5]
    siblings = {}
    for t, p in zip(grafted.tokens, grafted.parents):
        assert (p, t) not in siblings
        siblings[(p, t)] = True


def test_the_walk_takes_the_graft_where_the_target_follows_it():
    tree = _tree()
    grafted, _ = graft_chain(tree, [5, 7, 9, 10])
    target = [5, 7, 9, 10, 3]  # the target's tokens along its own path
    depth = [0] + grafted.depths()
    path, emitted = walk_tree(grafted.tokens, grafted.parents, lambda j: target[depth[j]])
    assert emitted == target and len(path) == 5  # root + 4 accepted (2 tree nodes, 2 grafted)
    # the tree alone accepts 2 and stops
    depth = [0] + tree.depths()
    path, emitted = walk_tree(tree.tokens, tree.parents, lambda j: target[depth[j]])
    assert emitted == target[:3] and len(path) == 3


def test_a_grafted_tree_verifies_greedy_like_the_target_alone():
    torch.manual_seed(0)
    logq, toks = torch.randn(4, 3).sort(dim=1, descending=True)[0], torch.randint(0, 16, (4, 3))
    for d in range(4):  # distinct within a row
        toks[d] = torch.randperm(16)[:3]
    tree = build_tree(logq, toks, 6)
    grafted, _ = graft_chain(tree, [1, 2, 3])
    logits = torch.randn(len(grafted.tokens) + 1, 16)
    out, path = verify_tree(logits, grafted.tokens, grafted.parents, SamplingParams(), None)
    assert out.tokens[0] == int(logits[0].argmax())  # row 0 is the target's own after the root
    for i, node in enumerate(path[1:]):  # every accepted node is the target's argmax after its parent row
        assert grafted.tokens[node - 1] == out.tokens[i]


class WrongTables(TableDrafts):
    """A draft tier whose every table is wrong at every depth (its tree never accepts)."""

    def propose(self, *a, **kw):
        got = super().propose(*a, **kw)
        if got.candidates is None:
            return got
        logq, table = got.candidates
        return DraftProposal([], None, candidates=(logq, table + 200))


def _generate(drafts, graft, max_tokens: int = 60) -> Generation:
    req = GenerationRequest(list(PROMPT), max_tokens, SamplingParams(), "block", 4, request_id="r", tree_budget=4)
    with ThreadPoolExecutor(2) as pool:
        gen = Generation(req, TreeTarget(), drafts, type("Tok", (), {"decode": lambda self, ids, **kw: ""})(), {99},
                         5.0, feature_spec=FeatureSpec((0, 1), W), tables=pool, graft=graft)
        list(gen.run())
    return gen


def test_a_grafted_loop_is_exact_and_takes_the_ngram_where_the_drafter_misses():
    """SCRIPT repeats every 20 tokens: once it has, the n-gram draft is right and the drafter's
    tables never are; the output is the target's, and the graft's tokens are the accepted ones."""
    graft = lambda context, k: propose_ngram(context, k, 2, 4)  # noqa: E731
    gen = _generate(WrongTables(), graft)
    assert gen.out.token_ids == SCRIPT[:60]
    s = gen.stats
    assert s.graft_rounds > 0 and s.graft_tokens == s.accepted_tokens > s.graft_rounds
    assert s.rounds < 40  # plain rounds would emit one token each: 59
    plain = _generate(WrongTables(), None)
    assert plain.out.token_ids == SCRIPT[:60]
    assert plain.stats.graft_rounds == 0 and plain.stats.accepted_tokens == 0 and plain.stats.rounds == 59


def test_the_tree_policy_learns_from_the_drafters_own_nodes_only():
    """With goodput on, a grafted round teaches the tree policy what the drafter's nodes emitted
    (here: nothing past the target's own token), not the graft's accepted run."""
    graft = lambda context, k: propose_ngram(context, k, 2, 4)  # noqa: E731
    req = GenerationRequest(list(PROMPT), 60, SamplingParams(), "block", 4, request_id="r", tree_budget=4, k_max=4)

    class CostedTarget(TreeTarget):
        def verify(self, *a, **kw):
            from dataclasses import replace
            return replace(super().verify(*a, **kw), cost={"rows": [1, 9], "seconds": [1.0, 1.01], "mean_batch": 1.0,
                                                           "live": 1})

    with ThreadPoolExecutor(2) as pool:
        gen = Generation(req, CostedTarget(), WrongTables(), type("Tok", (), {"decode": lambda self, ids, **kw: ""})(),
                         {99}, 5.0, feature_spec=FeatureSpec((0, 1), W), tables=pool, graft=graft)
        list(gen.run())
    assert gen.out.token_ids == SCRIPT[:60]
    policies = [p for p in gen.rounds.policies.values() if isinstance(p, TreePolicy)]
    assert policies and gen.stats.graft_tokens > 0
    learnt = [p for p in policies if p.rounds]
    # E(n) of the drafter's nodes falls toward 1 (its tables are always wrong), whatever the graft won
    assert learnt and all(max(p.expected) < 1.5 for p in learnt)
