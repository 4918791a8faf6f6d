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

The mesh's own kernels (row_exact=2, `batch_invariant: own`): some libraries run a one-row product
on a kernel of its own (a GEMV) and every product of 2 or more rows on one GEMM whose rows do not
depend on the row count. Seen on an AMD EPYC (Zen 4, avx512_bf16, no AMX), bf16 576x1536 (the
MLP's down projection): one-row calls differ from batched rows on 10 of 64 wide-range rows, while
every batched call up to 64 rows equals the first row of 2-row calls. install therefore probes a
linear whose one-row count is below CHEAP_ROWS a second time with every call of fewer than 2 rows
padded to 2 (the row repeated): the 2-row floor. Under rows(2) such a linear runs padded and in
chunks of that count in every step, the one-token decode included, and bf16 attention rows take
the row kernel (row_attn.enable_bf16): speculative output is bitwise the mesh's own decode in
that mode, which rounds apart from HF's one-row decode (in bf16 a near-tie flips against HF
`generate` in about half of 64-token outputs: docs/numerics.md). rows(1) (`batch_invariant:
true`) keeps HF's one-row kernels.

Element-wise ops and RoPE do not depend on the row count. A norm (RMSNorm, LayerNorm: a per-row
reduction) does not on a CPU, but a GPU's reduction kernel may split a row's sum differently for
few rows than for many, so install probes each norm like a linear and steps run it in chunks of
its count (on a CPU: every count at its limit, one call). Prefill
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

import types

import torch
import torch.nn.functional as F

from specmesh.engine import bf16rows, cpu_gemm, onednn, probecache, quant, rownorm
from specmesh.engine.loader import dtype_name
from specmesh.engine.rowprobe import (  # noqa: F401 (callers and tests read them here)
    _ACTIVE, KERNEL_PROBE_OUT, PROBE_HEAD_ROWS, PROBE_HEAD_TRIALS, PROBE_PACKED_ROWS, PROBE_ROWS, PROBE_TRIALS, _wide,
    invariant_rows, pow2_floor, rows)

CHEAP_ROWS = 8  # batch_invariant auto: deterministic when every probed count reaches this
PROBE_PACKED_HEAD_TRIALS = 3  # draws of a prepacked head probed on past PROBE_HEAD_ROWS (_extend_head)


def floored(apply, floor: int):
    """apply with every call of fewer than `floor` rows padded to `floor` (its last row repeated).
    apply(x [M, in], W, b) -> [M, out]."""
    if floor <= 1:
        return apply

    def run(x, w, b=None):
        m = x.shape[0]
        if m >= floor:
            return apply(x, w, b)
        return apply(torch.cat([x, x[-1:].expand(floor - m, -1)]), w, b)[:m]

    return run


def probe_rows(weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int,
               apply=F.linear, trials: int = PROBE_TRIALS, floor: int = 1) -> int:
    """The smallest invariant_rows of floored(apply, floor)(x, W', b') over `trials` draws of
    wide-range W', b', x shaped, strided and typed like weight / bias, rounded down to a power of
    two. weight: [out, in]; bias: [out] or None; apply(x [M, in], W', b') -> [M, out].

    Why the rounding: libraries block M in powers of two, and rows past a block (a tail kernel)
    can match the one-row calls on some data and not on other. Seen on an Intel Xeon (AMX), bf16
    576x576: over 16 draws the count was 32 in half of them and 34..64 in the rest; 4 draws gave
    36, and a 36-row chunk of real activations then differed from the one-row calls."""
    found = max_rows
    apply_f = floored(apply, floor)
    shape = tuple(weight.shape)
    if apply is not F.linear and not getattr(apply, "full_shape", False):  # the packed kernel: per output column one FMA chain over `in`, whatever
        shape = (min(shape[0], KERNEL_PROBE_OUT), shape[1])  # `out`: a few panels probe it as well as all
    with torch.no_grad():
        for t in range(trials):
            gen = torch.Generator().manual_seed(t)
            w = _wide(shape, weight, gen)
            b = _wide(shape[:1], bias, gen) if bias is not None else None
            x = _wide((max_rows + 1, weight.shape[1]), weight, gen)
            found = min(found, invariant_rows(lambda r: apply_f(r, w, b), x))
            if found == 0:
                break
    return pow2_floor(found)


def _apply_of(mod: torch.nn.Linear):
    """What a step runs for this linear: the packed CPU kernel where installed, oneDNN's
    prepacked call where onednn.install prepacked it, else F.linear."""
    if getattr(mod, "_specmesh_packed", None) is not None:
        return cpu_gemm.kernel_apply()
    return onednn.probe_apply() if onednn.is_packed(mod) else F.linear


def _probe(weight, bias, max_rows: int, apply, trials: int) -> tuple[int, int]:
    """(one-row count, 2-row-floor count): the second is probed only where the first is below
    CHEAP_ROWS (else 0: the floor is never used for this product)."""
    rows = _kept(weight, bias, max_rows, apply, trials, 1)
    if rows >= CHEAP_ROWS:
        return rows, 0
    return rows, _kept(weight, bias, max_rows, apply, trials, 2)


def _kept(weight, bias, max_rows: int, apply, trials: int, floor: int) -> int:
    """probe_rows, from probecache where it ran before on this machine and software (a kernel
    without a name probes every time)."""
    run = lambda: probe_rows(weight, bias, max_rows, apply=apply, trials=trials, floor=floor)  # noqa: E731
    kind = "F.linear" if apply is F.linear else getattr(apply, "kind", None)
    if kind is None:
        return run()
    return probecache.cached_for("rowexact.probe_rows", weight, bias, run, rows=max_rows, kernel=kind, trials=trials,
                                 floor=floor)


def chunking(one: int, two: int, mode: int) -> tuple[int, int]:
    """(rows per call, row floor) of a product probed (one, two), under rows(mode): the 2-row
    floor where mode 2 asks for it and it reaches further than the one-row calls."""
    if mode >= 2 and two > one:
        return max(1, two), 2
    return max(1, one), 1


def _probe_linears(model: torch.nn.Module) -> None:
    """Set ``_specmesh_rows`` (one-row count) and ``_specmesh_rows2`` (2-row-floor count) on every
    decoder nn.Linear (one probe per distinct shape / strides / dtype / device / bias presence /
    kernel)."""
    seen: dict[tuple, tuple[int, int]] = {}
    for mod in model.model.modules():
        if isinstance(mod, torch.nn.Linear):
            w = mod.weight
            kernel = getattr(mod, "_specmesh_packed", None) is not None
            prepacked = onednn.is_packed(mod)  # probed further: 256 rows on an AMX Xeon
            key = (tuple(w.shape), w.dtype, str(w.device), mod.bias is not None, w.stride(), kernel, prepacked)
            if key not in seen:
                seen[key] = _probe(w, mod.bias, PROBE_PACKED_ROWS if prepacked else PROBE_ROWS, _apply_of(mod),
                                   PROBE_TRIALS)
            mod._specmesh_rows, mod._specmesh_rows2 = seen[key]


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
    if x.dim() < 2:
        return F.linear(x, self.weight, self.bias)
    x2 = x.reshape(-1, x.shape[-1])  # [M, in] (a packed batch is contiguous: a view)
    if not _ACTIVE.get():
        out = onednn.packed(self, x2) if cpu_gemm.in_step() else None  # [M, out]: prepacked where installed
        return F.linear(x, self.weight, self.bias) if out is None else out.view(*x.shape[:-1], -1)
    out = bf16rows.call(self, x2, onednn.in_prefill(), det=True)  # every row bitwise a one-row call
    if out is not None:
        return out.view(*x.shape[:-1], -1)
    step, floor = chunking(getattr(self, "_specmesh_rows", 0), getattr(self, "_specmesh_rows2", 0), _ACTIVE.get())
    lin = floored(onednn.apply_of(self) or F.linear, floor)
    if x2.shape[0] <= step:
        return lin(x2, self.weight, self.bias).view(*x.shape[:-1], -1)
    # each chunk a 2-D [m, in] matrix: one mm, as the one-token step's folded [1, 1, in] input
    out = torch.cat([lin(x2[i : i + step], self.weight, self.bias) for i in range(0, x2.shape[0], step)])
    return out.view(*x.shape[:-1], -1)


def install(model: torch.nn.Module) -> torch.nn.Module:
    """Route the decoder's linears through linear_forward (inactive, i.e. HF's own calls, unless
    a step runs under rows(1 or 2)) and probe them and the LM head. Idempotent."""
    if getattr(model, "_specmesh_row_exact", False):
        return model
    route(model)
    _probe_linears(model)
    rownorm.probe_norms(model)
    head = model.get_output_embeddings()  # [V, H], the model's dtype (kv.lm_head)
    model._specmesh_head_rows, model._specmesh_head_rows2 = _probe(
        head.weight, None, PROBE_HEAD_ROWS, _apply_of(head), PROBE_HEAD_TRIALS)
    model._specmesh_row_exact = True
    _extend_head(model, head)
    return model


def _extend_head(model: torch.nn.Module, head: torch.nn.Linear) -> None:
    """A prepacked LM head that held to PROBE_HEAD_ROWS, where the deterministic mode is cheap
    (so `auto` picks it): probed on to PROBE_PACKED_ROWS, as the decoder's prepacked linears are,
    and its count replaced by what that finds. A deterministic verify of more rows (8 x 5 and up)
    then reads the 57 MB head of SmolLM2 once, not once per 32 rows: on the AMX Xeon, where it
    holds to 128, deterministic 16 x 5 164 -> 151 ms. Costs ~4.5 s a draw there at the first start
    (probecache keeps it), so only where the mode is likely to run: not on CPUs whose decoder
    linears already make it costly (a Zen 4's down projection)."""
    if model._specmesh_head_rows < PROBE_HEAD_ROWS or not onednn.is_packed(head) or not cheap(model, 1):
        return
    model._specmesh_head_rows = _kept(head.weight, None, PROBE_PACKED_ROWS, _apply_of(head),
                                      PROBE_PACKED_HEAD_TRIALS, 1)


def is_installed(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_specmesh_row_exact", False))


def head_chunking(model: torch.nn.Module, mode: int) -> tuple[int, int]:
    """(rows per call, row floor) of the LM head product under rows(mode) (install must have run)."""
    return chunking(int(getattr(model, "_specmesh_head_rows", 0)), int(getattr(model, "_specmesh_head_rows2", 0)), mode)


def probed(model: torch.nn.Module, mode: int = 1, kernel: bool = True) -> dict[str, int]:
    """What install probed, as rows(mode) runs it: {linear shape 'out x in dtype': rows per call,
    ..., 'NormClass H dtype': rows, 'lm_head dtype': rows} (for logs; ' (2-row floor)' appended where the floor is used;
    a linear on the exact bf16 rows kernel, bf16rows.py: PROBE_PACKED_ROWS, the most any chunk holds;
    kernel=False: what oneDNN's calls hold, the kernel aside)."""
    out = {}
    for mod in model.model.modules():
        if isinstance(mod, torch.nn.Linear) and hasattr(mod, "_specmesh_rows"):
            w = mod.weight
            if kernel and bf16rows.route(mod, PROBE_PACKED_ROWS, False, det=True) is not None:  # one-row bits
                out[f"{w.shape[0]}x{w.shape[1]} {dtype_name(w.dtype)} (exact rows kernel)"] = PROBE_PACKED_ROWS
                continue
            step, floor = chunking(mod._specmesh_rows, mod._specmesh_rows2, mode)
            out[f"{w.shape[0]}x{w.shape[1]} {dtype_name(w.dtype)}{' (2-row floor)' if floor > 1 else ''}"] = (
                mod._specmesh_rows if floor == 1 else step)
    for mod in rownorm.norms(model):
        if hasattr(mod, "_specmesh_rows"):
            out[f"{type(mod).__name__} {mod.weight.shape[0]} {dtype_name(mod.weight.dtype)}"] = mod._specmesh_rows
    step, floor = head_chunking(model, mode)
    head = f"lm_head {dtype_name(model.get_output_embeddings().weight.dtype)}{' (2-row floor)' if floor > 1 else ''}"
    out[head] = int(getattr(model, "_specmesh_head_rows", 0)) if floor == 1 else step
    return out


def cheap(model: torch.nn.Module, mode: int = 1) -> bool:
    """Whether deterministic verification under rows(mode) costs almost nothing on this machine:
    every count oneDNN's calls were probed to hold is at least CHEAP_ROWS (install must have run).
    The exact bf16 rows kernel (bf16rows.py) does not count: with it a Zen 4's deterministic
    forwards cost 1.04-1.18x the batched ones (micro-bench), but through the mesh 7 short requests
    decoding together paid 56.9 ms a token against 36.5 batched, and AR at concurrency 16 ~10%
    (session 40: docs/bench/engine.md#25), so there the mode stays one key away."""
    return is_installed(model) and min(probed(model, mode, kernel=False).values()) >= CHEAP_ROWS


def auto_mode(model: torch.nn.Module) -> int:
    """`batch_invariant: auto`: 1 where HF's one-row kernels make the mode cheap, else 0 (install
    must have run). Never 2: the mesh's own kernels round apart from HF's one-row decode, and in
    bf16 that flips a near-tie against HF `generate` in about half of 64-token outputs
    (docs/numerics.md), so they are one key away (`own`), not the default. Off a CPU, 0: cheap
    linears do not make the mode cheap there, since each verified row's attention is a call of
    its own (one kernel launch per row and layer; on an H200 in bf16, every linear probed
    invariant to 32+ rows, a 9-position verify cost 1.9x and a 16-node tree 3.5x the batched
    one: docs/bench/engine.md#11)."""
    if next(model.parameters()).device.type != "cpu":
        return 0
    return 1 if cheap(model, 1) else 0


def mode_for(model: torch.nn.Module, setting: bool | str) -> int:
    """target_worker.batch_invariant -> the row-exact mode: true -> 1 (HF's one-row kernels),
    "own" -> 2 (the mesh's own: the 2-row floor where probed, bf16 attention rows on the row
    kernel), false -> 0; "auto": auto_mode.
    Installs (probes) wherever the mode may be on."""
    if setting in ("auto", "own"):
        install(model)
        return auto_mode(model) if setting == "auto" else 2
    return int(bool(setting))
