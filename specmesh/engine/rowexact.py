"""Batch-invariant verification: every verified position is computed with the kernels of a
one-token decode step, so speculative output is bitwise what the target alone produces.

Why: a verify forward over Q positions multiplies an [M=Q*B, H] activation matrix, and GEMM
libraries pick different kernels (and summation orders) for M=1 and M>1; in bf16 the logits then
move by up to ~0.5 and a near-tie argmax can flip (docs/numerics.md). Here, while a RowPlan is
active (batched_step(..., row_exact=True)):

* every nn.Linear inside the decoder computes row by row: y[b, j] = F.linear(x[b, j:j+1], W, bias),
  the very call a one-token step makes (the weight stays in cache across the rows);
* attention computes query (b, j) alone against the key slots it may see, gathered in order
  (own KV, then its visible new tokens), with no mask: the call a one-token step makes over a
  cache of that length;
* the LM head (float32) is applied row by row as well (kv.batched_step).

Element-wise ops, RMSNorm (a per-row reduction) and RoPE do not depend on the row count, so each
position's logits equal the one-token step's bit for bit (tests/model/test_row_exact.py). The
price is per-row GEMV instead of one GEMM: small at batch 1, large at high concurrency
(docs/numerics.md has the measurements). Prefill is not affected: it is already the same call
as the target alone makes, as long as it is not padded into a batch (TargetEngine runs prefills
one at a time in this mode).
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_NAME = "specmesh_row_exact"


@dataclass(frozen=True)
class RowPlan:
    """counts[b]: real query rows of sequence b (later rows are padding, left zero);
    slots[b][j]: [n_bj] long, the key slots query (b, j) may see, in position order."""

    counts: list[int]
    slots: list[list[torch.Tensor]]


_PLAN: contextvars.ContextVar[RowPlan | None] = contextvars.ContextVar("specmesh_row_plan", default=None)


@contextlib.contextmanager
def active(plan: RowPlan):
    token = _PLAN.set(plan)
    try:
        yield
    finally:
        _PLAN.reset(token)


def plan_from_mask(mask: torch.Tensor, counts: list[int], device: torch.device | str = "cpu") -> RowPlan:
    """mask: [B, 1, Q, S] bool (query j of row b sees slot s) -> the RowPlan of its real rows,
    its slot indices on `device` (the keys' device: moved once here, not per layer)."""
    slots = [[mask[b, 0, j].nonzero().flatten().to(device) for j in range(n)] for b, n in enumerate(counts)]
    return RowPlan(list(counts), slots)


def _row_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x: [B, Q, in] -> [B, Q, out]; per real row under a plan, else one call."""
    plan = _PLAN.get()
    if plan is None or x.dim() != 3:
        return F.linear(x, self.weight, self.bias)
    out = x.new_zeros((*x.shape[:-1], self.out_features))
    for b, n in enumerate(plan.counts):
        for j in range(n):
            out[b, j : j + 1] = F.linear(x[b : b + 1, j : j + 1], self.weight, self.bias)[0]
    return out


def _row_attention(module, query, key, value, attention_mask, **kwargs):
    """query: [B, heads, Q, D]; key/value: [B, kv_heads, S, D] -> ([B, Q, heads, D], None).

    Under a plan, query (b, j) attends to key[b, :, slots[b][j]] alone, unmasked (HF's SDPA
    function, as in a one-token step); otherwise HF's SDPA path unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plan = _PLAN.get()
    if plan is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kw = {k: kwargs[k] for k in ("scaling", "dropout") if k in kwargs}
    out = query.new_zeros((query.shape[0], query.shape[2], query.shape[1], query.shape[3]))
    for b, n in enumerate(plan.counts):
        for j in range(n):
            idx = plan.slots[b][j]
            o, _ = sdpa_attention_forward(module, query[b : b + 1, :, j : j + 1], key[b : b + 1, :, idx],
                                          value[b : b + 1, :, idx], None, **kw)
            out[b, j] = o[0, 0]
    return out, None


def _check_supported(model: torch.nn.Module) -> None:
    cfg = model.config.get_text_config()
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        raise ValueError("batch-invariant verification does not support sliding-window attention "
                         f"({type(cfg).__name__}.sliding_window={cfg.sliding_window}); set "
                         "target_worker.batch_invariant: false for this model")


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Route the decoder's linears and attention through the row-exact paths (inactive, i.e.
    HF's own calls, unless batched_step runs under a plan). Idempotent; returns the model."""
    if getattr(model, "_specmesh_row_exact", False):
        return model
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    _check_supported(model)
    AttentionInterface.register(ATTN_NAME, _row_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)
    for mod in model.model.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.forward = types.MethodType(_row_linear, mod)
    model.set_attn_implementation(ATTN_NAME)
    model._specmesh_row_exact = True
    return model


def is_installed(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_specmesh_row_exact", False))
