"""Verification of drafted tokens against the target model (speculative sampling).

Greedy: accept the longest prefix of drafts that equal the target's argmax, then emit the
target's argmax at the first mismatch (recovered) or after the last draft (bonus).

Sampled (Leviathan et al. 2023, Chen et al. 2023): draft x_i ~ q_i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)). At the first rejection the recovered token is drawn from the
residual r_i = normalize(max(0, p_i - q_i)); if every draft is accepted the bonus token is
drawn from p_k. Then for every position P(emit y) = min(p, q)(y) + (1 - sum min(p, q)) r(y)
= p(y): the output distribution is exactly the target's (lossless).
"""

from __future__ import annotations

import torch

from specmesh.core.sampling import sample, warp_logits
from specmesh.core.types import DraftProposal, SamplingParams, VerifyOutcome


def verify_greedy(target_logits: torch.Tensor, draft_tokens: list[int]) -> VerifyOutcome:
    """Greedy verification.

    target_logits: [k+1, V] float32; row i = target logits after context + draft_tokens[:i].
    draft_tokens: k ints.
    n = longest prefix with draft[i] == argmax(row i); tokens = draft[:n] + [argmax(row n)].
    """
    k = len(draft_tokens)
    _check_rows(target_logits, k, "target_logits")
    target_argmax = target_logits.argmax(dim=-1).tolist()  # k+1 ints, ties -> lowest index
    n = 0
    while n < k and draft_tokens[n] == target_argmax[n]:
        n += 1
    return VerifyOutcome(
        accepted=n, tokens=list(draft_tokens[:n]) + [target_argmax[n]], bonus=n == k
    )


def verify_rejection(
    target_probs: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> VerifyOutcome:
    """Speculative (rejection) sampling; lossless w.r.t. target_probs.

    target_probs: [k+1, V] float32, already warped; row i = p_i, the target distribution
        after context + draft_tokens[:i].
    draft_tokens: k ints, x_i ~ q_i.
    draft_probs: [k, V] float32 rows q_i, or None = point mass q_i = 1[x_i] (n-gram drafts).
    generator: all randomness (k uniforms, then one categorical draw) comes from it.
    """
    k = len(draft_tokens)
    _check_rows(target_probs, k, "target_probs")
    if k == 0:
        return VerifyOutcome(accepted=0, tokens=[_draw(target_probs[0], generator)], bonus=True)
    vocab = target_probs.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"draft_probs must be [{k}, {vocab}], got {tuple(draft_probs.shape)}")
    if any(not 0 <= t < vocab for t in draft_tokens):
        raise ValueError(f"draft token out of range [0, {vocab}): {draft_tokens}")
    if draft_probs is not None:
        draft_probs = draft_probs.to(device=target_probs.device, dtype=target_probs.dtype)

    n = _count_accepted(target_probs, draft_tokens, draft_probs, generator)
    if n == k:
        # every draft accepted: bonus token t ~ p_k
        bonus = _draw(target_probs[k], generator)
        return VerifyOutcome(accepted=k, tokens=list(draft_tokens) + [bonus], bonus=True)
    q_n = None if draft_probs is None else draft_probs[n]  # [V] or None
    residual = _residual(target_probs[n], draft_tokens[n], q_n)  # [V]
    recovered = _draw(residual, generator)
    return VerifyOutcome(accepted=n, tokens=list(draft_tokens[:n]) + [recovered], bonus=False)


def verify(
    target_logits: torch.Tensor,
    draft: DraftProposal,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> VerifyOutcome:
    """Dispatch on params: greedy -> argmax matching; else warp the target and rejection-sample.

    target_logits: [k+1, V] float32, k = len(draft.token_ids).
    draft.probs (if any) must already be warped with the same params (see sampling.warp_logits).
    """
    if params.greedy:
        return verify_greedy(target_logits, draft.token_ids)
    target_probs = warp_logits(target_logits, params)  # [k+1, V] float32
    return verify_rejection(target_probs, draft.token_ids, draft.probs, generator)


def _count_accepted(
    target_probs: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> int:
    """Number n of leading drafts accepted.

    target_probs: [k+1, V]; draft_probs: [k, V] or None (q_i(x_i) = 1).
    Draft i is accepted iff u_i * q_i(x_i) < p_i(x_i) with u_i ~ U[0, 1), i.e. with probability
    min(1, p_i(x_i) / q_i(x_i)). q_i(x_i) == 0 is rejected outright (the drafter claimed a token
    it could not have drawn; the residual then still yields an exact sample from p_i).
    All k uniforms are drawn up front so the generator advances the same way every round.
    """
    k = len(draft_tokens)
    idx = torch.tensor([[t] for t in draft_tokens], device=target_probs.device)  # [k, 1] int64
    p_x = [r[0] for r in target_probs.narrow(0, 0, k).gather(1, idx).tolist()]  # k floats p_i(x_i)
    q_x = [1.0] * k if draft_probs is None else [r[0] for r in draft_probs.gather(1, idx).tolist()]
    u = torch.rand(k, generator=generator, dtype=torch.float64).tolist()  # k floats U[0, 1)
    for i in range(k):
        if not (q_x[i] > 0.0 and u[i] * q_x[i] < p_x[i]):
            return i
    return k


def _residual(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """Recovery distribution at the first rejection: r = max(0, p - q) (unnormalised).

    p: [V] target row; q: [V] draft row, or None = point mass on `token`, where
    max(0, p - 1[token]) is p with p(token) zeroed. If r is all zero (p == q up to rounding,
    which a rejection makes a measure-zero event) fall back to p itself.
    """
    if q is None:
        r = p.clone()
        r[token] = 0.0
    else:
        r = torch.clamp(p - q, min=0.0)
    return r if float(r.sum()) > 0.0 else p


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """probs: [V] non-negative (unnormalised ok) -> one token id drawn from it."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)  # the draw needs the generator's device
    return int(sample(probs.unsqueeze(0), generator)[0])


def _check_rows(t: torch.Tensor, k: int, name: str) -> None:
    """t: must be [k+1, V] with V >= 1."""
    if t.dim() != 2 or t.shape[0] != k + 1 or t.shape[1] == 0:
        raise ValueError(f"{name} must be [k+1={k + 1}, V], got shape {tuple(t.shape)}")
