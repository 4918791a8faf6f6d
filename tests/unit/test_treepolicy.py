"""A draft tree's node budget chosen per round for goodput (specmesh/core/treepolicy.py), with
hand-built costs and acceptances; the best-first prefix property it relies on, on random trees."""

import pytest
import torch

from specmesh.core.tree import build_tree
from specmesh.core.goodput import seed_curve
from specmesh.core.treepolicy import TreePolicy, emitted_by_budget, path_nodes


def test_a_smaller_budget_builds_the_first_nodes_of_a_larger_one():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        logq = torch.log_softmax(torch.randn(4, 40, generator=gen) * 3, dim=-1)  # [D=4, V=40]
        big_lp, big_tok = logq.topk(16, dim=-1)
        big = build_tree(big_lp, big_tok, 16)
        for n in (1, 2, 3, 5, 8):
            lp, tok = logq.topk(n, dim=-1)  # what the draft worker does for a budget of n
            small = build_tree(lp, tok, n)
            assert small.tokens == big.tokens[:n] and small.parents == big.parents[:n]


def test_the_accepted_path_tells_every_smaller_budget_its_tokens():
    #      root -> 0 (5) -> 2 (7) -> 4 (9)
    #           -> 1 (6)    3 (8) under 0
    parents, draft = [-1, -1, 0, 0, 2], [5, 6, 7, 8, 9]
    path = path_nodes(parents, draft, [5, 7, 9])
    assert path == [0, 2, 4]
    # n = 1: node 0 only -> 1 accepted + the target's token; n = 3 adds node 2; n = 5 node 4
    assert emitted_by_budget(path, 5) == [2.0, 2.0, 3.0, 3.0, 4.0]
    assert emitted_by_budget(path, 7) == [2.0, 2.0, 3.0, 3.0, 4.0, 4.0, 4.0]  # same tree past 5 nodes
    assert path_nodes(parents, draft, [6, 1]) == [1]  # the second branch, then a miss
    assert path_nodes(parents, draft, [42]) == [] and emitted_by_budget([], 3) == [1.0, 1.0, 1.0]


def test_the_budget_follows_the_cost_of_a_row():
    """Measured tokens per round by budget (a drafter whose first node is its best bet); a row that
    costs 0.5% of a step runs the whole tree, 10% a small one, 60% none."""
    expected = [1.55, 1.62, 1.66, 1.69, 1.72, 1.75, 1.78, 1.81]
    for per_row, want in ((0.005, 8), (0.10, 1), (0.60, 0)):
        p = TreePolicy(budget=8, seed=expected, probe_every=0)
        assert p.choose(lambda q, r=per_row: 1.0 + r * (q - 1)) == want, per_row
    # n = 1: 1.55 / 1.1 = 1.41 beats n = 2: 1.62 / 1.2 = 1.35 and n = 0: 1.0
    assert TreePolicy(budget=8, seed=expected).best(lambda q: 1.0 + 0.1 * (q - 1))[1] == pytest.approx(1.55 / 1.1)


def test_k_zero_is_chosen_and_probes_the_whole_budget():
    costly = lambda q: 1.0 + 0.2 * (q - 1)  # noqa: E731 - a row costs 20% of a step
    p = TreePolicy(budget=8, seed=[1.1] * 8, probe_every=4)
    used = [p.choose(costly) for _ in range(8)]
    assert used == [0, 0, 0, 8, 0, 0, 0, 8]  # off, but every 4th round drafts all 8 nodes
    assert p.history == {0: 6, 8: 2}


def test_learning_moves_the_budget_and_hysteresis_holds_it():
    per_row = lambda q: 1.0 + 0.02 * (q - 1)  # noqa: E731
    p = TreePolicy(budget=8, seed=1.8, probe_every=0)  # seeded: the whole tree pays
    assert p.choose(per_row) == 8
    for _ in range(30):  # only the likeliest node is ever accepted: one node does what 8 do
        p.update(emitted_by_budget([0], 8))
    assert p.expected[0] == pytest.approx(p.expected[-1], abs=1e-2) and p.choose(per_row) == 1
    # two nodes a hair better (1.981 vs 1.961 tokens per step) do not move it: the margin is a
    # share of one token (0.05 / step)
    p.expected[1] = 2.06
    assert p.best(per_row)[0] == 2 and p.choose(per_row) == 1
    p.expected[1] = 2.2  # 2.115 vs 1.961: it moves
    assert p.choose(per_row) == 2


def test_the_seed_curve_is_concave_and_ends_at_the_whole_tree():
    curve = seed_curve(1.5, 8)
    assert curve[-1] == pytest.approx(1.5) and curve[0] > 1.0
    steps = [b - a for a, b in zip(curve, curve[1:])]
    assert all(x > 0 for x in steps) and steps == sorted(steps, reverse=True)
    assert seed_curve(0.5, 4) == [1.0] * 4  # never below the target's own token


def test_beside_others_a_probe_is_priced():
    """Beside live others a probe costs every sequence of the forward: it drafts the largest
    budget within probe_loss of the goodput in force, none where rows are dear or from 0 nodes."""
    # a row costs 20% of a step, 3 others emitting 3 tokens: any node loses > 3% -> no probe
    costly = lambda q: 1.0 + 0.2 * (q - 1)  # noqa: E731
    p = TreePolicy(budget=8, seed=[1.1] * 8, probe_every=4)
    assert [p.choose(costly, others=3.0, beside=True) for _ in range(8)] == [0] * 8
    assert [p.choose(costly) for _ in range(4)] == [0, 0, 0, 8]  # alone: the whole budget
    # rows nearly free (a GPU-like forward): the probe is the whole budget beside others too
    cheap = lambda q: 1.0 + 0.002 * (q - 1)  # noqa: E731
    p = TreePolicy(budget=8, seed=[1.5, 1.52, 1.53, 1.54, 1.55, 1.56, 1.57, 1.58], probe_every=2)
    assert [p.choose(cheap, others=15.0, beside=True) for _ in range(2)] == [1, 8]  # n = 1 in force, then a probe
    p = TreePolicy(budget=8, seed=[1.01] * 8, probe_every=1)  # 0 in force: no probe even where rows are free
    assert [p.choose(cheap, others=15.0, beside=True) for _ in range(3)] == [0, 0, 0]
    assert p.choose(cheap) == 8  # alone: the whole budget
    # n = 1 in force (1.5 / 1.1); a probe within 3% of it: (3 + 1.52) / 1.2 = 3.77 against
    # 0.97 * 4.5 / 1.1 = 3.97: none; with rows at 1% of a step the floor is 0.97 * 4.5 / 1.01 = 4.32:
    # 5 nodes 4.55 / 1.05 = 4.33 fit, 6 nodes 4.56 / 1.06 = 4.30 do not
    mid = lambda q: 1.0 + 0.1 * (q - 1)  # noqa: E731
    p = TreePolicy(budget=8, seed=[1.5, 1.52, 1.53, 1.54, 1.55, 1.56, 1.57, 1.58], probe_every=2)
    assert [p.choose(mid, others=3.0, beside=True) for _ in range(4)] == [1, 1, 1, 1]
    low = lambda q: 1.0 + 0.01 * (q - 1)  # noqa: E731
    assert p._probe(low, 3.0) == 5 and p._probe(mid, 3.0) == 1
