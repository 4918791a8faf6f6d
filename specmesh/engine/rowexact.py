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
position's logits equal the one-token step's bit for bit (tests/model/test_row_exact.py). Prefill
is not affected: it is already the same call as the target alone makes, as long as it is not
padded into a batch (TargetEngine runs prefills one at a time in this mode).

The price is per-row GEMV instead of one GEMM, unless the GEMM is probed row-invariant. Which
kernel a library runs, and so its summation order, is chosen by the shapes, strides, dtype, device
and thread count, not by the values. ``install`` probes each distinct linear shape (and the float32
LM head) once: the largest M such that a batched call over M rows gives, for every M' <= M,
bitwise the rows of M' one-row calls, on wide-range random data (values 2^-12 .. 2^12, so any
other summation order shows through the output's rounding; real weights mostly hide it). Up to
that M the batched call is used as is; beyond it, per row. Measured on a CPU with native bf16
(oneDNN): the bf16 GEMMs with K=576 are row-invariant at every M probed (64), K=1536 (down_proj)
is not even at M=2, float32 GEMV (M=1) and GEMM differ. The probe runs under the thread count in
force at install, which the worker sets before loading the model.
"""

from __future__ import annotations

import contextlib
import contextvars
import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specmesh.engine.loader import dtype_name

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


PROBE_ROWS = 64  # largest batched row count probed for the decoder's linears
PROBE_HEAD_ROWS = 32  # ... and for the LM head (a bigger GEMM: V x H)
PROBE_TRIALS = 4  # random draws per probe; the smallest count found wins


def invariant_rows(fn, rows: torch.Tensor) -> int:
    """Largest M <= len(rows) such that for every M' <= M, fn(rows[:M']) equals, bit for bit, the
    concatenation of fn(rows[i:i+1]) (0 if even M=1 is not reproducible).
    fn: [M, in] -> [M, out]; rows: [M_max, in]."""
    singles = torch.cat([fn(rows[i : i + 1]) for i in range(rows.shape[0])])  # [M_max, out]
    for m in range(1, rows.shape[0] + 1):
        if not torch.equal(fn(rows[:m]), singles[:m]):
            return m - 1
    return rows.shape[0]


def _wide(shape, like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """N(0,1) x 2^e, e uniform in -12..12, in like's dtype and device (and strides when the shape
    is like's): products of such values round differently under any other summation order. Rows
    beyond the first 1024 repeat them (the order under test runs along the last axis)."""
    block = (min(shape[0], 1024), *shape[1:])
    vals = torch.randn(block, generator=gen) * torch.exp2(torch.randint(-12, 13, block, generator=gen).float())
    vals = vals.repeat(-(-shape[0] // block[0]), *[1] * (len(shape) - 1))[: shape[0]]
    out = (torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
           if tuple(like.shape) == tuple(shape) else torch.empty(shape, dtype=like.dtype, device=like.device))
    return out.copy_(vals)


def probe_rows(weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int,
               apply=F.linear, trials: int = PROBE_TRIALS) -> int:
    """The smallest invariant_rows of apply(x, W', b') over `trials` draws of wide-range W', b', x
    shaped, strided and typed like weight / bias. weight: [out, in]; bias: [out] or None;
    apply(x [M, in], W', b') -> [M, out]."""
    found = max_rows
    with torch.no_grad():
        for t in range(trials):
            gen = torch.Generator().manual_seed(t)
            w = _wide(tuple(weight.shape), weight, gen)
            b = _wide(tuple(bias.shape), bias, gen) if bias is not None else None
            rows = _wide((max_rows, weight.shape[1]), weight, gen)
            found = min(found, invariant_rows(lambda x: apply(x, w, b), rows))
            if found == 0:
                break
    return found


def _probe_linears(model: torch.nn.Module) -> None:
    """Set ``_specmesh_rows`` on every decoder nn.Linear: its probed invariant row count (one probe
    per distinct shape / strides / dtype / device / bias presence)."""
    seen: dict[tuple, int] = {}
    for mod in model.model.modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight
            key = (tuple(w.shape), w.dtype, str(w.device), mod.bias is not None, w.stride())
            if key not in seen:
                seen[key] = probe_rows(w, mod.bias, PROBE_ROWS)
            mod._specmesh_rows = seen[key]


def _row_linear(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x: [B, Q, in] -> [B, Q, out]; under a plan: one batched call when its B*Q rows are within
    the probed invariant count (bitwise the per-row result), else per real row."""
    plan = _PLAN.get()
    if plan is None or x.dim() != 3:
        return F.linear(x, self.weight, self.bias)
    m = x.shape[0] * x.shape[1]
    if m <= getattr(self, "_specmesh_rows", 0):  # [M, in] contiguous, exactly as probed
        return F.linear(x.reshape(m, x.shape[2]), self.weight, self.bias).view(*x.shape[:2], -1)
    out = x.new_zeros((*x.shape[:-1], self.out_features))
    for b, n in enumerate(plan.counts):
        for j in range(n):
            # the row as a 2-D [1, in] matrix: one mm, as the one-token step's folded [1, 1, in] input.
            # (A [1, 1, in] slice of a wider batch does not fold when no weight needs grad: matmul
            # then expands W and runs bmm, copying W every call.)
            out[b, j : j + 1] = F.linear(x[b, j : j + 1], self.weight, self.bias)
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
    _probe_linears(model)
    from specmesh.engine.kv import lm_head_fp32  # kv imports this module: import at call time

    head = lm_head_fp32(model)  # [V, H] float32, the head every path applies
    model._specmesh_head_rows = probe_rows(head, None, PROBE_HEAD_ROWS, apply=lambda x, w, _: x @ w.T)
    model.set_attn_implementation(ATTN_NAME)
    model._specmesh_row_exact = True
    return model


def is_installed(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_specmesh_row_exact", False))


def head_rows(model: torch.nn.Module) -> int:
    """Probed invariant row count of the float32 LM head product (0 when not installed)."""
    return int(getattr(model, "_specmesh_head_rows", 0))


def probed(model: torch.nn.Module) -> dict[str, int]:
    """What install probed: {linear shape 'out x in dtype': rows, ..., 'lm_head': rows} (for logs)."""
    out = {}
    for mod in model.model.modules():
        if isinstance(mod, torch.nn.Linear) and hasattr(mod, "_specmesh_rows"):
            w = mod.weight
            out[f"{w.shape[0]}x{w.shape[1]} {dtype_name(w.dtype)}"] = mod._specmesh_rows
    out["lm_head float32"] = head_rows(model)
    return out
