"""The truncated-proposal figures (specmesh/bench/proposal.py) on hand-built distributions."""

import torch

from specmesh.bench.proposal import alphas, chain_accepted, request_bytes


def test_alpha_is_the_overlap_and_truncation_can_only_move_it_by_the_tail():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]])
    q = torch.tensor([[0.4, 0.2, 0.1, 0.3]])
    assert torch.allclose(alphas(p, q, 0), torch.tensor([0.4 + 0.2 + 0.1]))
    # top-2 of q: {0: 0.4, 3: 0.3} renormalised to 4/7, 3/7 -> min with p: 0.5 + 0 + 0 + 0
    assert torch.allclose(alphas(p, q, 2), torch.tensor([0.5]))
    assert torch.allclose(alphas(p, p, 0), torch.tensor([1.0]))  # the draft is the target: all accepted


def test_chain_acceptance_multiplies_along_the_text():
    a = torch.tensor([0.5, 1.0, 0.0])
    # from t=0 (k=2): 0.5 + 0.5*1.0 = 1.0; t=1: 1.0 + 0.0 = 1.0; t=2: 0.0 -> mean 2/3
    assert abs(chain_accepted(a, 2) - 2 / 3) < 1e-9
    assert chain_accepted(torch.ones(4), 4) == (4 + 3 + 2 + 1) / 4  # a chain cannot run past the text


def test_a_sparse_row_is_smaller_than_a_dense_one_on_the_wire():
    q = torch.softmax(torch.randn(4, 5000), dim=-1)
    tokens = [int(t) for t in q.argmax(dim=-1)]
    dense, sparse = request_bytes(q, tokens, 0), request_bytes(q, tokens, 16)
    assert dense > 4 * 5000 * 4 and sparse < 4 * 16 * 8 + 200
