"""Greedy verification and lossless speculative (rejection) sampling.

The distribution tests are seeded, so they are deterministic; tolerances leave >3x margin
over the expected sampling error, and each test also checks that a plausible bug (recovered
token drawn from p instead of the residual) would land far outside the tolerance.
"""

from __future__ import annotations

import pytest
import torch

from specmesh.core import rejection
from specmesh.core.rejection import verify, verify_greedy, verify_rejection
from specmesh.core.sampling import make_generator
from specmesh.core.types import DraftProposal, SamplingParams

V = 6
P = torch.tensor([0.30, 0.25, 0.20, 0.12, 0.08, 0.05])  # target p, the same at every position
Q = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.20, 0.30])  # draft q, deliberately far from p
R = torch.tensor([0.60, 0.10, 0.10, 0.10, 0.05, 0.05])  # n-gram drafter's token choice (unknown q)
UNRELATED = torch.tensor([0.05, 0.05, 0.30, 0.30, 0.20, 0.10])


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    """Total-variation distance 1/2 * sum |a - b| between two distributions (any shape)."""
    return 0.5 * float((a.double() - b.double()).abs().sum())


def freq(tokens: list[int], size: int = V) -> torch.Tensor:
    """Empirical distribution [size] of token ids."""
    return torch.bincount(torch.tensor(tokens), minlength=size).double() / len(tokens)


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# ---------------------------------------------------------------- greedy


def test_greedy_all_accepted_gives_bonus():
    # argmax per row: 2, 0, 3 ; drafts [2, 0] match both -> bonus 3
    logits = _logits([[0, 1, 5, 2], [9, 1, 1, 1], [0, 0, 1, 4]])
    out = verify_greedy(logits, [2, 0])
    assert (out.accepted, out.tokens, out.bonus, out.recovered) == (2, [2, 0, 3], True, False)


def test_greedy_first_rejected_gives_recovered():
    logits = _logits([[0, 1, 5, 2], [9, 1, 1, 1], [0, 0, 1, 4]])
    out = verify_greedy(logits, [1, 0])
    assert (out.accepted, out.tokens, out.bonus, out.recovered) == (0, [2], False, True)


def test_greedy_middle_rejection():
    logits = _logits([[0, 1, 5, 2], [9, 1, 1, 1], [0, 0, 1, 4], [1, 1, 1, 1]])
    out = verify_greedy(logits, [2, 0, 1])  # third draft 1 != argmax 3
    assert (out.accepted, out.tokens, out.bonus) == (2, [2, 0, 3], False)


def test_greedy_k0_and_ties():
    out = verify_greedy(_logits([[1, 7, 7, 0]]), [])  # tie -> lowest index
    assert (out.accepted, out.tokens, out.bonus) == (0, [1], True)


def test_shape_errors():
    with pytest.raises(ValueError):
        verify_greedy(_logits([[0, 1], [1, 0]]), [0, 1])  # needs k+1 = 3 rows
    with pytest.raises(ValueError):
        verify_rejection(P.expand(2, V), [0], Q.expand(2, V), None)  # draft_probs must be [1, V]
    with pytest.raises(ValueError):
        verify_rejection(P.expand(2, V), [V], None, None)  # token out of range


# ---------------------------------------------------------------- rejection: edge cases


def test_rejection_k0_samples_row0():
    gen = make_generator(0)
    outs = [verify_rejection(P[None], [], None, gen) for _ in range(200)]
    assert all(o.accepted == 0 and o.bonus and len(o.tokens) == 1 for o in outs)
    assert {o.tokens[0] for o in outs} == set(range(V))


def test_rejection_point_mass_target_is_deterministic():
    # p one-hot on the drafts: accepted with prob 1, bonus from one-hot row 3
    target = torch.eye(V)[[4, 1, 2, 5]]  # [4, V]
    out = verify_rejection(target, [4, 1, 2], Q.expand(3, V), make_generator(1))
    assert (out.accepted, out.tokens, out.bonus) == (3, [4, 1, 2, 5], True)
    # p(x_1) == 0: always rejected at 1; residual max(0, p_1 - q_1) is one-hot on 3
    target = torch.eye(V)[[4, 3, 2, 5]]
    out = verify_rejection(target, [4, 1, 2], Q.expand(3, V), make_generator(1))
    assert (out.accepted, out.tokens, out.bonus) == (1, [4, 3], False)


def test_rejection_q_zero_rejects_and_zero_residual_falls_back_to_p():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])  # [2, 4]
    gen = make_generator(2)
    # q == p, so max(0, p - q) == 0; q(x=2) == 0 forces a rejection -> recovered ~ p_0
    outs = [verify_rejection(p, [2], p[:1], gen) for _ in range(100)]
    assert all(o.accepted == 0 and not o.bonus for o in outs)
    assert {o.tokens[0] for o in outs} == {0, 1}


# ---------------------------------------------------------------- rejection: distributions


def _first_tokens(n: int, seed: int, draft_from: torch.Tensor, q: torch.Tensor | None) -> list[int]:
    """First emitted token of n independent k=1 rounds; drafts x ~ draft_from, q as given."""
    gen = make_generator(seed)
    drafts = torch.multinomial(draft_from, n, replacement=True, generator=gen).tolist()
    target = P.expand(2, V).contiguous()  # [2, V]
    draft_probs = None if q is None else q[None].contiguous()  # [1, V]
    return [verify_rejection(target, [x], draft_probs, gen).tokens[0] for x in drafts]


def _check_converges_to_p(tokens: list[int], wrong: torch.Tensor, tol: float) -> None:
    tv_small, tv_large = tv(freq(tokens[:2000]), P), tv(freq(tokens), P)
    assert tv_large < tv_small, (tv_large, tv_small)
    assert tv_large < tol, tv_large
    for other in (Q, UNRELATED, wrong):  # each is > 0.1 from p
        assert tv(freq(tokens), other) > 8 * tv_large


def test_rejection_sampling_is_lossless():
    tokens = _first_tokens(32_000, seed=11, draft_from=Q, q=Q)
    # the bug "recovered ~ p" would emit min(p, q) + (1 - sum min(p, q)) * p instead of p
    overlap = torch.minimum(P, Q)
    buggy = overlap + (1 - overlap.sum()) * P
    assert tv(buggy, P) > 0.15
    _check_converges_to_p(tokens, buggy, tol=0.015)


def test_rejection_sampling_point_mass_draft_is_lossless():
    # n-gram drafts: x ~ R (unknown to the verifier), q = point mass on x
    tokens = _first_tokens(12_000, seed=12, draft_from=R, q=None)
    # the bug "recovered ~ p (x not zeroed)" would emit p(y) * (R(y) + 1 - sum_x R(x) p(x))
    buggy = P * (R + 1 - (R * P).sum())
    assert tv(buggy, P) > 0.1
    _check_converges_to_p(tokens, buggy, tol=0.025)


def test_residual_bug_is_detected(monkeypatch):
    # the distribution test must be able to fail: recover from p instead of the residual
    monkeypatch.setattr(rejection, "_residual", lambda p, token, q: p)
    tokens = _first_tokens(2000, seed=11, draft_from=Q, q=Q)
    assert tv(freq(tokens), P) > 0.1


def test_second_token_is_right_with_k3():
    """Context-free toy: p and q identical at every position, so the emitted stream must be
    i.i.d. p. Run rounds (k=3, fresh drafts each round) until two tokens are out, and compare
    the joint histogram of (first, second) with p x p."""
    k, n = 3, 8_000
    gen = make_generator(13)
    pool = iter(torch.multinomial(Q, 8 * n, replacement=True, generator=gen).tolist())
    target, draft_probs = P.expand(k + 1, V).contiguous(), Q.expand(k, V).contiguous()
    pairs = []
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            drafts = [next(pool) for _ in range(k)]
            out += verify_rejection(target, drafts, draft_probs, gen).tokens
        pairs.append(out[0] * V + out[1])
    joint = freq(pairs, V * V).view(V, V)  # [V, V], joint[a, b] = P(first=a, second=b)
    assert tv(joint, torch.outer(P, P)) < 0.06
    assert tv(joint.sum(0), P) < 0.025  # second-token marginal
    # conditioned on the most common first token, the second is still ~ p
    cond = joint[0] / joint[0].sum()
    assert tv(cond, P) < 0.06
    assert tv(joint.sum(0), Q) > 0.3


# ---------------------------------------------------------------- dispatch


def test_verify_dispatch_greedy_and_sampled():
    logits = _logits([[0, 1, 5, 2], [9, 1, 1, 1], [0, 0, 1, 4]])
    draft = DraftProposal(token_ids=[2, 1])
    greedy = verify(logits, draft, SamplingParams(temperature=0.0), None)
    assert (greedy.accepted, greedy.tokens) == (1, [2, 0])
    # top_k=1 warps the target to a one-hot on argmax: sampled verification must agree
    sampled = verify(logits, draft, SamplingParams(temperature=0.8, top_k=1), make_generator(0))
    assert sampled == greedy
    # with draft probs and a real temperature, tokens come from the right vocabulary
    probs = torch.softmax(torch.randn(2, 4, generator=make_generator(1)), dim=-1)
    params = SamplingParams(temperature=1.0)
    out = verify(logits, DraftProposal([2, 1], probs), params, make_generator(2))
    assert 1 <= len(out.tokens) <= 3 and all(0 <= t < 4 for t in out.tokens)


def test_a_truncated_proposal_sent_sparse_is_lossless():
    """T > 0 over the wire: the drafter samples from its distribution kept on its top 3 tokens
    (sampling.truncate) and sends exactly that row (rpc.convert; sparse where that is smaller,
    tests/unit/test_sparse_probs.py); the verifier decodes it
    and the emitted tokens still follow p. Half of p's mass lies outside the truncated support, so
    the residual must supply it."""
    from specmesh.core.sampling import truncate
    from specmesh.rpc.convert import probs_to_wire, proposal_from_pb

    q3 = truncate(Q[None], 3)[0]  # [V]: Q's 3 likeliest tokens (ids 3, 4, 5), renormalised
    assert int((q3 > 0).sum()) == 3 and abs(float(q3.sum()) - 1) < 1e-6
    gen = make_generator(13)
    drafts = torch.multinomial(q3, 16_000, replacement=True, generator=gen).tolist()
    target = P.expand(2, V).contiguous()
    tokens = []
    for x in drafts:
        dense, sparse = probs_to_wire(q3[None])
        sent = proposal_from_pb([x], dense, V, sparse=sparse)  # what the target worker decodes
        assert torch.equal(sent.probs[0], q3)
        tokens.append(verify_rejection(target, sent.token_ids, sent.probs, gen).tokens[0])
    overlap = torch.minimum(P, q3)
    buggy = overlap + (1 - overlap.sum()) * P  # recovered ~ p instead of the residual
    assert tv(buggy, P) > 0.1
    _check_converges_to_p(tokens, buggy, tol=0.02)
