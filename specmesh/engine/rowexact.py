"""Batch-invariant (deterministic) verification: every verified position is computed with the
kernels of a one-token decode step, so speculative output is bitwise what the target alone
produces, whatever the batch.

Why: a verify forward multiplies an [M, H] activation matrix, and GEMM libraries pick different
kernels (and summation orders) for M=1 and M>1; the logits then move in their last bits (in bf16
by up to ~0.5) and a near-tie argmax can flip (docs/numerics.md). While `rows(True)` is active
(batched_step(..., row_exact=True)):

* every nn.Linear inside the decoder computes its M rows in chunks of its probed invariant row
  count (below), which is bitwise the one-row calls a one-token step makes; where the probe found
  no such count (0 or 1), row by row;
* attention computes each query row alone against exactly the slots it sees (kv.pool_attention);
* the LM head runs in chunks of its own probed count (kv.lm_head).

Element-wise ops, RMSNorm (a per-row reduction) and RoPE do not depend on the row count. Prefill
is not affected: it is already the call the target alone makes, as long as it is not packed with
other prompts (TargetEngine prefills one prompt per forward in this mode).

Which kernel a library runs, and so its summation order, is chosen by the shapes, strides, dtype,
device and thread count, not by the values. ``install`` probes each distinct linear shape (and the
LM head) once: the largest M such that a batched call over M' rows gives bitwise the rows of M'
one-row calls for every M' <= M, from an aligned start and from an offset one (a chunk of a
larger batch), on wide-range random data (values 2^-12 .. 2^12, so any other summation order shows
through the output's rounding; real weights mostly hide it), over several draws, rounded down to
a power of two (probe_rows says why). ``cheap`` says whether the probe
found deterministic verification nearly free (every count >= CHEAP_ROWS): `batch_invariant: auto`
turns it on exactly then. The probe runs under the thread count in force at install, which the
worker sets before loading the model.
"""

from __future__ import annotations

import contextlib
import contextvars
import types

import torch
import torch.nn.functional as F

from specmesh.engine import cpu_gemm, quant
from specmesh.engine.loader import dtype_name

_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("specmesh_row_exact", default=False)

PROBE_ROWS = 64  # largest batched row count probed for the decoder's linears
PROBE_HEAD_ROWS = 32  # ... and for the LM head (a bigger GEMM: V x H)
PROBE_TRIALS = 12  # random draws per linear shape; the smallest count found wins
PROBE_HEAD_TRIALS = 6  # ... for the LM head (each draw costs ~0.5 s there)
KERNEL_PROBE_OUT = 96  # output columns a probe of the packed kernel draws (6 panels, odd pairs and tails)
CHEAP_ROWS = 8  # batch_invariant auto: deterministic when every probed count reaches this


@contextlib.contextmanager
def rows(active: bool):
    token = _ACTIVE.set(active)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def invariant_rows(fn, rows: torch.Tensor) -> int:
    """Largest M < len(rows) such that for every M' <= M, fn(rows[:M']) and fn(rows[1:1 + M'])
    equal, bit for bit, the concatenation of one-row calls fn(rows[i:i+1]) (0 if even M=1 is not
    reproducible). fn: [M, in] -> [M, out]; rows: [M_max, in]."""
    singles = torch.cat([fn(rows[i : i + 1]) for i in range(rows.shape[0])])  # [M_max, out]
    for m in range(1, rows.shape[0]):
        if not (torch.equal(fn(rows[:m]), singles[:m]) and torch.equal(fn(rows[1 : 1 + m]), singles[1 : 1 + m])):
            return m - 1
    return rows.shape[0] - 1


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
    shaped, strided and typed like weight / bias, rounded down to a power of two. weight: [out,
    in]; bias: [out] or None; apply(x [M, in], W', b') -> [M, out].

    Why the rounding: libraries block M in powers of two, and rows past a block (a tail kernel)
    can match the one-row calls on some data and not on other. Seen on an Intel Xeon (AMX), bf16
    576x576: over 16 draws the count was 32 in half of them and 34..64 in the rest; 4 draws gave
    36, and a 36-row chunk of real activations then differed from the one-row calls."""
    found = max_rows
    shape = tuple(weight.shape)
    if apply is not F.linear:  # the packed kernel: per output column one FMA chain over `in`, whatever
        shape = (min(shape[0], KERNEL_PROBE_OUT), shape[1])  # `out`: a few panels probe it as well as all
    with torch.no_grad():
        for t in range(trials):
            gen = torch.Generator().manual_seed(t)
            w = _wide(shape, weight, gen)
            b = _wide(shape[:1], bias, gen) if bias is not None else None
            x = _wide((max_rows + 1, weight.shape[1]), weight, gen)
            found = min(found, invariant_rows(lambda r: apply(r, w, b), x))
            if found == 0:
                break
    return 1 << (found.bit_length() - 1) if found else 0


def _apply_of(mod: torch.nn.Linear):
    """What a step runs for this linear: the packed CPU kernel where installed, else F.linear."""
    return cpu_gemm.kernel_apply() if getattr(mod, "_specmesh_packed", None) is not None else F.linear


def _probe_linears(model: torch.nn.Module) -> None:
    """Set ``_specmesh_rows`` on every decoder nn.Linear: its probed invariant row count (one probe
    per distinct shape / strides / dtype / device / bias presence / kernel)."""
    seen: dict[tuple, int] = {}
    for mod in model.model.modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight
            kernel = getattr(mod, "_specmesh_packed", None) is not None
            key = (tuple(w.shape), w.dtype, str(w.device), mod.bias is not None, w.stride(), kernel)
            if key not in seen:
                seen[key] = probe_rows(w, mod.bias, PROBE_ROWS, apply=_apply_of(mod))
            mod._specmesh_rows = seen[key]


def route(model: torch.nn.Module) -> None:
    """Send every decoder nn.Linear through linear_forward (HF's own F.linear outside steps)."""
    for mod in model.model.modules():
        if isinstance(mod, torch.nn.Linear) and not getattr(mod, "_specmesh_routed", False):
            mod.forward = types.MethodType(linear_forward, mod)
            mod._specmesh_routed = True


def linear_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x: [..., in] -> [..., out]. Inside a step: the packed CPU kernel where installed (row-
    invariant at any row count); else, deterministic steps in chunks of the probed invariant row
    count (bitwise the one-row calls), one row per call where the probe found none. A draft
    model's int8 copy (quant.py) where it has one, in default-mode steps."""
    out = None if _ACTIVE.get() else quant.apply(self, x)
    if out is None:
        out = cpu_gemm.packed(self, x, exact=_ACTIVE.get())
    if out is not None:
        return out
    if not _ACTIVE.get() or x.dim() < 2:
        return F.linear(x, self.weight, self.bias)
    x2 = x.reshape(-1, x.shape[-1])  # [M, in] (a packed batch is contiguous: a view)
    step = max(1, getattr(self, "_specmesh_rows", 0))
    if x2.shape[0] <= step:
        return F.linear(x2, self.weight, self.bias).view(*x.shape[:-1], -1)
    # each chunk a 2-D [m, in] matrix: one mm, as the one-token step's folded [1, 1, in] input
    out = torch.cat([F.linear(x2[i : i + step], self.weight, self.bias) for i in range(0, x2.shape[0], step)])
    return out.view(*x.shape[:-1], -1)


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Route the decoder's linears through linear_forward (inactive, i.e. HF's own calls, unless
    a step runs under rows(True)) and probe them and the LM head. Idempotent."""
    if getattr(model, "_specmesh_row_exact", False):
        return model
    route(model)
    _probe_linears(model)
    head = model.get_output_embeddings()  # [V, H], the model's dtype (kv.lm_head)
    model._specmesh_head_rows = probe_rows(head.weight, None, PROBE_HEAD_ROWS, apply=_apply_of(head),
                                          trials=PROBE_HEAD_TRIALS)
    model._specmesh_row_exact = True
    return model


def is_installed(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_specmesh_row_exact", False))


def head_rows(model: torch.nn.Module) -> int:
    """Probed invariant row count of the LM head product (0 when not installed)."""
    return int(getattr(model, "_specmesh_head_rows", 0))


def probed(model: torch.nn.Module) -> dict[str, int]:
    """What install probed: {linear shape 'out x in dtype': rows, ..., 'lm_head': rows} (for logs)."""
    out = {}
    for mod in model.model.modules():
        if isinstance(mod, torch.nn.Linear) and hasattr(mod, "_specmesh_rows"):
            w = mod.weight
            out[f"{w.shape[0]}x{w.shape[1]} {dtype_name(w.dtype)}"] = mod._specmesh_rows
    out[f"lm_head {dtype_name(model.get_output_embeddings().weight.dtype)}"] = head_rows(model)
    return out


def cheap(model: torch.nn.Module) -> bool:
    """Whether deterministic verification costs almost nothing on this machine: every probed
    count is at least CHEAP_ROWS (install must have run)."""
    return is_installed(model) and min(probed(model).values()) >= CHEAP_ROWS
