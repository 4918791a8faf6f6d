"""Logit warping (temperature, top-k, top-p) and seeded sampling. Pure torch, no I/O.

The target and the draft tier must warp with the *same* function so that the rejection sampler
compares like with like: q_i (draft) and p_i (target) are both distributions *after* warping.
"""

from __future__ import annotations

import os

import torch

from specmesh.core.types import SamplingParams

_U64 = 1 << 64


def make_generator(seed: int | None) -> torch.Generator:
    """A CPU torch.Generator seeded with `seed` (taken mod 2**64), or from os.urandom if None."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    gen = torch.Generator()
    gen.manual_seed(seed % _U64)
    return gen


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn raw logits into the distribution that decoding samples from.

    logits: [N, V] float (any float dtype; computed in float32)
    returns probs: [N, V] float32, each row sums to 1.

    Greedy (temperature == 0): one-hot on argmax (ties -> lowest index, as torch.argmax).
    Otherwise: z = (logits - max) / T; keep top-k of z; softmax; keep the nucleus of mass top_p;
    renormalise. Subtracting the row max first leaves softmax unchanged but keeps z <= 0, so a
    tiny T cannot overflow to inf - inf = NaN.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    x = logits.float()
    n, v = x.shape
    if params.greedy or n == 0 or v == 0:
        return _one_hot_argmax(x)
    # z = (l - max_j l_j) / T  -> softmax(z) == softmax(l / T)
    z = (x - x.max(dim=-1, keepdim=True).values) / params.temperature
    if 0 < params.top_k < v:
        z = _mask_top_k(z, params.top_k)
    probs = torch.softmax(z, dim=-1)
    if params.top_p < 1.0:
        probs = _mask_top_p(probs, params.top_p)
    return probs


def truncate(probs: torch.Tensor, k: int) -> torch.Tensor:
    """probs: [B, V] -> the same rows kept on their k most likely tokens and renormalised (k <= 0
    or k >= V: unchanged). A drafter that samples from the truncated rows and sends exactly them
    stays lossless (rejection sampling needs the proposal the token was drawn from, whatever it
    is) and its rows travel sparse: k entries instead of V."""
    if k <= 0 or k >= probs.shape[-1]:
        return probs
    vals, idx = probs.topk(k, dim=-1)  # [B, k]
    out = torch.zeros_like(probs)
    return out.scatter_(-1, idx, vals / vals.sum(dim=-1, keepdim=True))


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row: tokens[i] ~ Categorical(probs[i]).

    probs: [N, V] float, non-negative rows (need not be exactly normalised)
    returns tokens: [N] int64.

    By the inverse CDF: one uniform u per row, the first token whose running sum (float64)
    exceeds u times the row's sum; a token of probability 0 adds nothing to the sum, so it is
    never drawn. torch.multinomial draws V exponentials per row instead: ~1 ms a row at a
    49,152-token vocabulary on a 2-core AMX Xeon against ~50 us here, 16 ms of a ~58 ms forward
    at 16 sequences, 14% of the target worker's time at T=1 (docs/bench/round_policy.md#session-45).
    Rows with a single non-zero entry (one-hot, i.e. greedy; detected as max == sum, which for a
    non-negative row holds iff every other entry is 0, up to float absorption) return that
    entry's index, so greedy decoding never depends on the draw's float behaviour.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [N, V], got shape {tuple(probs.shape)}")
    if probs.shape[0] == 0:
        return torch.empty(0, dtype=torch.long, device=probs.device)
    cdf = probs.double().cumsum(dim=-1)  # [N, V]
    total = cdf[:, -1:].contiguous()  # [N, 1]
    if not bool(torch.isfinite(total).all() and (total > 0).all() and probs.min() >= 0):
        raise ValueError("probs rows must be finite, non-negative and not all zero")
    u = torch.rand(total.shape, generator=generator, dtype=torch.float64, device=probs.device)  # [N, 1] in [0, 1)
    # u < 1 and round-to-nearest keep u * total below total, so the first running sum above it is
    # a token's own (one that added mass): never past the last token of non-zero probability
    tokens = torch.searchsorted(cdf, u * total, right=True).squeeze(-1)  # [N]
    top, top_idx = probs.max(dim=-1)  # [N], [N]
    return torch.where(top >= probs.sum(dim=-1), top_idx, tokens)


def _one_hot_argmax(x: torch.Tensor) -> torch.Tensor:
    """x: [N, V] float32 -> [N, V] float32 with probs[i, argmax_j x[i, j]] = 1, rest 0."""
    out = torch.zeros_like(x)
    if x.shape[0] == 0 or x.shape[1] == 0:
        return out
    out.scatter_(-1, x.argmax(dim=-1, keepdim=True), 1.0)
    return out


def _sorted_desc(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [N, V] -> (values, indices), each [N, V], descending; stable, so ties keep index order."""
    return torch.sort(x, dim=-1, descending=True, stable=True)


def _mask_top_k(z: torch.Tensor, k: int) -> torch.Tensor:
    """Keep exactly the k largest entries per row (ties -> lower index wins); others -> -inf.

    z: [N, V] float32, 0 < k < V.
    """
    _, order = _sorted_desc(z)  # order: [N, V] int64
    drop = order[:, k:]  # [N, V-k] indices ranked k..V-1
    return z.scatter(-1, drop, float("-inf"))


def _mask_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus: keep the smallest highest-probability set S with sum_{j in S} p_j >= top_p.

    probs: [N, V] float32 rows summing to 1; 0 < top_p < 1.
    With tokens sorted by p descending, rank r is kept iff the mass strictly before it,
    c_r - p_r = sum_{s<r} p_s, is < top_p. Rank 0 has mass 0 before it, so it is always kept.
    Returns the renormalised probs: p_j * 1[j in S] / sum_{s in S} p_s.
    """
    sorted_p, order = _sorted_desc(probs)  # [N, V], [N, V]
    mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # [N, V] exclusive cumsum
    keep_sorted = mass_before < top_p  # [N, V] bool, in sorted order
    keep_sorted[:, 0] = True
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)  # back to vocab order
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)
