"""Draft trees (DDTree-style): build a best-first tree from per-position top-k candidates, lay
it out for ONE target forward, and walk it. Pure torch, no I/O.

Build. A block drafter gives, for each draft depth d = 1..D, K candidate tokens tok[d-1, r]
with log-probabilities lp[d-1, r] (rank r = 0..K-1, sorted descending). A tree node at depth d
with rank r under parent u scores s = s(u) + lp[d-1, r] (s(root) = 0): the log-probability of
its root path under the drafter's per-position marginals. Best-first with a max-heap on s:
pop the best node, add it, then push its next sibling (same parent, rank r+1) and its first
child (depth d+1, rank 0). Since lp <= 0 and each row is sorted, s(child) <= s(parent) and
s(next sibling) <= s(node): every node enters the heap only after its parent and elder sibling
were taken, so the first B nodes popped are a prefix-closed top-B set (parents and elder
siblings included) and the node list is in topological order (parent before child).

Layout. The verify input is [root, n_1..n_N] with the root = the pending token (index 0) and
draft node i at index i+1. Node j may attend to itself and its ancestors (ancestor mask
M[j, i] = 1 iff i is on the root path of j) and sits at position cache_length + depth(j).

Walk. From the root, choose y ~ p(. | root path) (T = 0: y = argmax), emit y; if a child of
the current node carries token y, move to it and repeat; else stop. Each emitted token is
drawn from the target's own conditional given exactly the tokens emitted before it (row j of
the target logits is the distribution after the root path of j, by the mask and positions), so
the output is distributed exactly as plain target sampling: P(y_1..y_m) = prod_t p(y_t | y_<t).
A child is only a cache of the next row; the drafter's probabilities never enter (a point-mass
draft: accept iff the target's sample equals it). Siblings carry distinct tokens (one top-k
row), so at most one child matches.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable

import torch

from specmesh.core.sampling import sample, warp_logits
from specmesh.core.types import SamplingParams, VerifyOutcome


@dataclass(frozen=True)
class DraftTree:
    """N draft nodes in topological order. parents[i]: index of node i's parent among the
    drafts, -1 for a child of the root (the pending token)."""

    tokens: list[int]
    parents: list[int]
    scores: list[float]  # cumulative drafter log-probability of each node's root path

    def depths(self) -> list[int]:
        """Depth of each draft node (children of the root have depth 1)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out


def build_tree(logprobs: torch.Tensor, tokens: torch.Tensor, budget: int, max_depth: int | None = None) -> DraftTree:
    """Best-first draft tree of at most `budget` nodes (see the module doc).

    logprobs: [D, K] float, row d-1 = log q of the depth-d candidates, sorted descending.
    tokens:   [D, K] int, the candidate token ids (distinct within a row).
    max_depth: deepest level used (default D). Candidates with log-probability -inf are skipped.
    """
    if logprobs.shape != tokens.shape or logprobs.dim() != 2:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and tokens {tuple(tokens.shape)} must be equal [D, K]")
    depth_cap, k = logprobs.shape
    depth_cap = depth_cap if max_depth is None else min(depth_cap, max_depth)
    lp, tok = logprobs.tolist(), tokens.tolist()
    out_tok: list[int] = []
    out_par: list[int] = []
    out_score: list[float] = []
    heap: list[tuple[float, int, int, int, int, float]] = []  # (-score, order, depth, rank, parent, score)
    order = 0

    def push(depth: int, rank: int, parent: int, base: float) -> None:
        nonlocal order
        if depth > depth_cap or rank >= k:
            return
        score = base + lp[depth - 1][rank]
        if score != float("-inf"):
            heapq.heappush(heap, (-score, order, depth, rank, parent, score))
            order += 1

    push(1, 0, -1, 0.0)
    while heap and len(out_tok) < budget:
        _, _, depth, rank, parent, score = heapq.heappop(heap)
        node = len(out_tok)
        out_tok.append(int(tok[depth - 1][rank]))
        out_par.append(parent)
        out_score.append(score)
        base = 0.0 if parent < 0 else out_score[parent]
        push(depth, rank + 1, parent, base)  # next sibling
        push(depth + 1, 0, node, score)  # first child
    return DraftTree(out_tok, out_par, out_score)


def graft_chain(tree: DraftTree, chain: list[int]) -> tuple[DraftTree, int]:
    """The tree with a chain of drafts (an n-gram match's continuation) added as a root path:
    the chain walks the tree's nodes while they carry its tokens, and the rest of it is appended
    below the last one it reached, so siblings stay distinct and the first len(tree.tokens) nodes
    are the tree unchanged (index, token and parent). -> (grafted tree, nodes added). A graft
    never changes the walk's law (module doc): it only caches more of the target's rows."""
    tokens, parents, scores = list(tree.tokens), list(tree.parents), list(tree.scores)
    children: dict[tuple[int, int], int] = {(p, t): i for i, (t, p) in enumerate(zip(tokens, parents))}
    node = -1
    for tok in chain:
        nxt = children.get((node, tok))
        if nxt is None:  # off the tree from here: the rest of the chain hangs below node
            nxt = len(tokens)
            tokens.append(int(tok))
            parents.append(node)
            scores.append(float("-inf"))  # not the drafter's: no drafter log-probability
            children[(node, tok)] = nxt
        node = nxt
    return DraftTree(tokens, parents, scores), len(tokens) - len(tree.tokens)


def tree_layout(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify-forward layout of [root, drafts]: (ancestor mask [N+1, N+1] bool, depths [N+1] long).

    parents: N ints, parents[i] in [-1, i) (topological). mask[j, i] = 1 iff node i is node j
    or one of its ancestors (the root, index 0, is everyone's ancestor); depth(root) = 0.
    """
    n = len(parents)
    mask = torch.zeros((n + 1, n + 1), dtype=torch.bool)
    depths = torch.zeros(n + 1, dtype=torch.long)
    mask[0, 0] = True
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: must be in [-1, {i}) (topological order)")
        j, pj = i + 1, p + 1  # indices in the verify input (root at 0)
        mask[j] = mask[pj]  # ancestors of the parent ...
        mask[j, j] = True  # ... plus itself
        depths[j] = depths[pj] + 1
    return mask, depths


def walk_tree(tokens: list[int], parents: list[int], choose: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """Walk from the root (see the module doc).

    choose(j) -> the target's token at verify row j (argmax, or a sample from p_j).
    Returns (path, emitted): path = verify-input indices of the accepted nodes, starting with the
    root 0 (the KV slots to keep); emitted = the accepted draft tokens + the target's last token.
    """
    children: list[dict[int, int]] = [{} for _ in range(len(tokens) + 1)]
    for i, (t, p) in enumerate(zip(tokens, parents)):
        children[p + 1].setdefault(t, i + 1)  # a duplicate sibling can never be reached: keep the first
    path, emitted, node = [0], [], 0
    while True:
        y = choose(node)
        emitted.append(y)
        nxt = children[node].get(y)
        if nxt is None:
            return path, emitted
        path.append(nxt)
        node = nxt


def verify_tree(target_logits: torch.Tensor, tokens: list[int], parents: list[int], params: SamplingParams,
                generator: torch.Generator | None) -> tuple[VerifyOutcome, list[int]]:
    """Verify a draft tree from one forward's logits; lossless (module doc).

    target_logits: [N+1, V] float32, row j = target logits after the root path of input node j.
    Returns (outcome, path): outcome.accepted = accepted drafts, outcome.tokens = those drafts +
    one target token, outcome.bonus = the walk ended at a leaf; path = input indices to keep.
    """
    if target_logits.dim() != 2 or target_logits.shape[0] != len(tokens) + 1:
        raise ValueError(f"target_logits must be [N+1={len(tokens) + 1}, V], got {tuple(target_logits.shape)}")
    if params.greedy:
        argmax = target_logits.argmax(dim=-1).tolist()  # N+1 ints, ties -> lowest index
        choose = argmax.__getitem__
    else:
        def choose(j: int) -> int:
            p = warp_logits(target_logits[j: j + 1], params)  # [1, V] warped target row
            return int(sample(p, generator)[0])
    path, emitted = walk_tree(tokens, parents, choose)
    leaf = all(p + 1 != path[-1] for p in parents)
    return VerifyOutcome(accepted=len(path) - 1, tokens=emitted, bonus=leaf), path
