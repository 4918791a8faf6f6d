"""Draft trees (specmesh.core.tree): best-first building, the verify layout, the walk, and the
target engine verifying a tree in one forward (a tiny random llama, fp32)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specmesh.core.rejection import verify_greedy
from specmesh.core.tree import build_tree, tree_layout, verify_tree, walk_tree
from specmesh.core.types import DraftProposal, FeatureSpec, SamplingParams

GREEDY = SamplingParams()


def _lp(rows):
    """rows: per depth, a list of probabilities -> (log-probs [D, K], tokens [D, K]) sorted desc;
    the token of rank r at depth d is 10 * d + r."""
    lp = torch.log(torch.tensor(rows, dtype=torch.float64))
    order = lp.argsort(dim=1, descending=True)
    tokens = torch.tensor([[10 * (d + 1) + r for r in range(len(rows[0]))] for d in range(len(rows))])
    return lp.gather(1, order), tokens.gather(1, order)


def _brute_top(lp: torch.Tensor, budget: int) -> set[tuple[int, ...]]:
    """All rank paths (r_1..r_d) scored by sum of log-probs; the best `budget` (ties impossible here)."""
    depth, k = lp.shape
    paths = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    score = {p: sum(float(lp[i, r]) for i, r in enumerate(p)) for p in paths}
    return set(sorted(paths, key=lambda p: -score[p])[:budget])


def _rank_paths(tree, lp, tokens) -> set[tuple[int, ...]]:
    tok_rank = {int(tokens[d, r]): r for d in range(tokens.shape[0]) for r in range(tokens.shape[1])}
    out = []
    for i in range(len(tree.tokens)):
        p = (tok_rank[tree.tokens[i]],) if tree.parents[i] < 0 else out[tree.parents[i]] + (tok_rank[tree.tokens[i]],)
        out.append(p)
    return set(out)


# ------------------------------------------------------------------ building

def test_best_first_tree_golden():
    lp, tok = _lp([[0.6, 0.25, 0.15], [0.5, 0.4, 0.1], [0.9, 0.05, 0.05]])
    tree = build_tree(lp, tok, budget=5)
    # path probabilities: a=.6, a.a=.3, a.a.a=.27, b=.25, a.b=.24 (next: a.a.b=.015*.., b.a=.125)
    assert tree.tokens == [10, 20, 30, 11, 21]
    assert tree.parents == [-1, 0, 1, -1, 0]
    assert tree.depths() == [1, 2, 3, 1, 2]
    assert [round(math.exp(s), 4) for s in tree.scores] == [0.6, 0.3, 0.27, 0.25, 0.24]


@pytest.mark.parametrize("budget", [1, 2, 4, 7, 12, 39])
def test_tree_is_the_prefix_closed_top_budget_set(budget):
    g = torch.Generator().manual_seed(budget)
    probs = torch.rand(3, 3, generator=g, dtype=torch.float64) + 0.05
    probs = (probs / probs.sum(1, keepdim=True)).tolist()
    lp, tok = _lp(probs)
    tree = build_tree(lp, tok, budget)
    paths = _rank_paths(tree, lp, tok)
    assert len(tree.tokens) == min(budget, 3 + 9 + 27)
    assert paths == _brute_top(lp, budget)
    assert all(p[:-1] in paths for p in paths if len(p) > 1), "not prefix-closed"
    assert all(tree.parents[i] < i for i in range(len(tree.parents))), "not topological"


def test_max_depth_and_impossible_candidates():
    lp, tok = _lp([[0.7, 0.3], [0.9, 0.1], [0.9, 0.1]])
    tree = build_tree(lp, tok, budget=10, max_depth=2)
    assert max(tree.depths()) == 2 and len(tree.tokens) == 6
    lp2 = lp.clone()
    lp2[:, 1] = float("-inf")  # e.g. cut by top-k / top-p warping
    assert build_tree(lp2, tok, budget=10).parents == [-1, 0, 1]


def test_ancestor_mask_and_depths():
    # root -> 0 -> 1, root -> 2, 0 -> 3
    mask, depths = tree_layout([-1, 0, -1, 0])
    assert depths.tolist() == [0, 1, 2, 1, 2]
    want = [[1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [1, 1, 1, 0, 0],
            [1, 0, 0, 1, 0],
            [1, 1, 0, 0, 1]]
    assert mask.int().tolist() == want
    chain_mask, chain_depths = tree_layout([-1, 0, 1, 2])
    assert torch.equal(chain_mask, torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    assert chain_depths.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        tree_layout([-1, 2, 0])


# ------------------------------------------------------------------ walking

def test_walk_follows_matching_children():
    tokens, parents = [5, 6, 7, 8], [-1, 0, -1, 1]  # root->5->6->8, root->7
    choice = {0: 5, 1: 6, 2: 8, 4: 9}  # input index -> target token
    path, emitted = walk_tree(tokens, parents, choice.__getitem__)
    assert path == [0, 1, 2, 4] and emitted == [5, 6, 8, 9]
    path, emitted = walk_tree(tokens, parents, {0: 3}.__getitem__)
    assert path == [0] and emitted == [3]


def test_chain_shaped_tree_verifies_exactly_like_chain():
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        k = trial % 6
        logits = torch.randn(k + 1, 7, generator=g)  # [k+1, V]
        argmax = logits.argmax(-1).tolist()
        drafts = [argmax[i] if torch.rand((), generator=g) < 0.7 else (argmax[i] + 1) % 7 for i in range(k)]
        chain = verify_greedy(logits, drafts)
        tree, path = verify_tree(logits, drafts, list(range(-1, k - 1)), GREEDY, None)
        assert (tree.accepted, tree.tokens, tree.bonus) == (chain.accepted, chain.tokens, chain.bonus)
        assert path == list(range(chain.accepted + 1))


def _two_level_case():
    """V = 4. Root row p0; the tree has children {0, 2} of the root, child 0 has children {1, 3}.
    Target rows: input 0 = root, 1 = node '0', 2 = node '2', 3 = '0'->'1', 4 = '0'->'3'."""
    logits = torch.tensor([[1.0, 0.2, 0.7, -0.5],
                           [0.1, 1.2, -0.3, 0.4],
                           [0.0, 0.0, 0.9, 0.3],
                           [0.5, 0.5, 0.5, 0.5],
                           [0.2, -1.0, 0.3, 0.0]])
    return logits, [0, 2, 1, 3], [-1, -1, 0, 0]


def _sample_pairs(walker, n: int, seed: int) -> torch.Tensor:
    """Counts [4, 5]: first emitted token x second (index 4 = the walk stopped after one token)."""
    logits, tokens, parents = _two_level_case()
    params = SamplingParams(temperature=0.8)
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(4, 5)
    for _ in range(n):
        emitted = walker(logits, tokens, parents, params, gen)
        counts[emitted[0], emitted[1] if len(emitted) > 1 else 4] += 1
    return counts


def _expected(n: int) -> torch.Tensor:
    """Under the target alone: P(y1) from the root row; P(y2 | y1) from y1's node when the tree
    has y1 (else the round stops after y1: column 4)."""
    logits, _, _ = _two_level_case()
    p = torch.softmax(logits / 0.8, dim=-1)
    exp = torch.zeros(4, 5)
    node_of = {0: 1, 2: 2}
    for y1 in range(4):
        if y1 in node_of:
            exp[y1, :4] = p[0, y1] * p[node_of[y1]]
        else:
            exp[y1, 4] = p[0, y1]
    return exp * n


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> float:
    m = expected > 0
    if counts[~m].sum() > 0:  # an impossible outcome
        return float("inf")
    return float(((counts[m] - expected[m]) ** 2 / expected[m]).sum())


def _lossless_walk(logits, tokens, parents, params, gen):
    return verify_tree(logits, tokens, parents, params, gen)[0].tokens


def _biased_walk(logits, tokens, parents, params, gen):
    """A WRONG walk: accepts the root's first child outright (what trusting the draft does)."""
    out = verify_tree(logits, tokens, parents, params, gen)[0].tokens
    return [tokens[0]] + out[1:] if out[0] != tokens[0] and torch.rand((), generator=gen) < 0.3 else out


def test_sampled_tree_walk_keeps_the_target_distribution():
    n = 12000
    expected = _expected(n)
    dof = int((expected > 0).sum()) - 1  # 10 cells
    critical = 29.6  # chi-square 0.999 quantile at 10 dof: a correct walk fails 1 in 1000 seeds
    assert _chi2(_sample_pairs(_lossless_walk, n, seed=1), expected) < critical, dof
    # the same statistic catches a biased walk (power check: the test can fail)
    assert _chi2(_sample_pairs(_biased_walk, n, seed=2), expected) > critical


# ------------------------------------------------------------------ one forward (tiny model)

@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).float().eval()


def test_tree_forward_matches_each_root_path(tiny_model):
    """Row j of the tree forward == the last row of a plain forward of prefix + root path of j."""
    from specmesh.engine.kv import batched_step, new_sequence_kv

    prefix, pending = [3, 9, 4, 17], 21
    tokens, parents = [5, 6, 7, 8], [-1, 0, -1, 1]
    kv = new_sequence_kv(tiny_model)
    batched_step(tiny_model, [kv], [prefix])
    kv.commit(len(prefix))
    mask, depths = tree_layout(parents)
    tree_out = batched_step(tiny_model, [kv], [[pending] + tokens], new_masks=[mask], depths=[depths])[0]
    paths = {0: [pending], 1: [pending, 5], 2: [pending, 5, 6], 3: [pending, 7], 4: [pending, 5, 6, 8]}
    for j, path in paths.items():
        fresh = new_sequence_kv(tiny_model)
        ref = batched_step(tiny_model, [fresh], [prefix + path])[0].logits[-1]
        assert torch.allclose(tree_out.logits[j], ref, atol=1e-4), j


def test_engine_verifies_a_tree_and_keeps_the_accepted_path(tiny_model):
    """Greedy: the tree holds the target's own continuation on one branch; the engine accepts it,
    its cache equals a plain prefill of everything emitted, and the features are the path's."""
    from specmesh.engine.kv import batched_step, new_sequence_kv
    from target_worker.engine import TargetEngine

    engine = TargetEngine(tiny_model, max_batch_size=4, max_sequences=4, max_tokens=1000, idle_timeout_s=60)
    try:
        prompt = [3, 9, 4, 17, 2]
        spec = FeatureSpec(layers=(0, 2), max_rows=3)
        first = engine.prefill_outcome("s", prompt, GREEDY, timeout=60, features=spec)
        assert first.features.shape == (3, 64) and first.features.dtype == torch.bfloat16
        greedy = _greedy(tiny_model, prompt + [first.token], 3)  # the target's next 3 tokens
        wrong = (greedy[0] + 1) % 64
        tokens, parents = [wrong, greedy[0], greedy[1], 7], [-1, -1, 1, 0]
        out = engine.verify("s", DraftProposal(tokens, None, parents), timeout=60, features=spec)
        assert (out.accepted, out.tokens, out.bonus) == (2, greedy[:3], True)
        assert out.features.shape == (3, 64)
        seq = engine._seqs["s"]
        assert seq.kv.length == len(prompt) + 3 and seq.pending == greedy[2]
        fresh = new_sequence_kv(tiny_model)
        everything = prompt + [first.token] + greedy[:2]
        ref = batched_step(tiny_model, [fresh], [everything], hidden_layers=(1, 3))[0]
        fresh.commit(len(everything))
        assert fresh.length == seq.kv.length
        for layer in range(seq.kv.num_layers):  # the pool slots hold the accepted path, moved down
            assert torch.allclose(seq.kv.keys(layer, seq.kv.length), fresh.keys(layer, fresh.length), atol=1e-4)
            assert torch.allclose(seq.kv.values(layer, seq.kv.length), fresh.values(layer, fresh.length), atol=1e-4)
        ref_feats = torch.cat(ref.hidden_states, dim=-1)[-3:].to(torch.bfloat16)
        assert torch.allclose(out.features.float(), ref_feats.float(), atol=2e-2)
        plain = engine.verify("s", DraftProposal([]), timeout=60)
        assert plain.features is None  # not asked: not computed
    finally:
        engine.close()


def _greedy(model, ids: list[int], n: int) -> list[int]:
    out = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1].float()
            out.append(int(logits.argmax()))
    return out
