"""bf16 CPU linears from weights prepacked once for oneDNN, inside engine steps, where a start-up
probe proves them bitwise torch's own F.linear.

Why: torch runs a bf16 CPU F.linear through oneDNN's matmul, which reorders the weight into its
blocked layout on every call. A step of a small model is a few hundred such calls on few rows, so
the reorder is much of the step. Measured on a 2-core Intel Xeon with AMX, one thread, torch 2.13:
one row through SmolLM2-135M's 576x1536 linear 115 us with F.linear, 60 us from a weight
reordered once (`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise`, the ops
torch's own compiler uses for frozen CPU linears); 80 rows 234 vs 150 us.

Bitwise: the prepacked call runs the same kernel on the same data. `install` checks it per
distinct weight shape on wide-range random data (rowprobe._wide: any other summation order shows
through the output's rounding), several draws, and keeps two counts:

    equal_rows   the largest M such that the prepacked call over M' rows equals F.linear's over
                 the same M' rows, for every M' <= M (there: 32 rows; F.linear itself changes
                 kernel past 32)
    gain         F.linear's one-row time / the prepacked one's (the best of a few calls each)

A linear is prepacked only where equal_rows >= 1 (so a one-token step is HF's arithmetic, bit for
bit, and the mesh's AR stays HF `generate`'s) and gain >= 1. Inside a step (cpu_gemm.in_step) it
then runs every call of up to equal_rows rows (bitwise F.linear's), and any larger call of a step
that holds no prompt's prefill (decode and verify rows, which are not HF's arithmetic past
equal_rows whichever kernel runs them); a step with a prefill keeps F.linear past equal_rows, so a
prompt's KV is HF's. Deterministic steps (rowexact.rows) run it in chunks of its own probed
row-invariant count: rowexact probes what a step runs (there: 128 rows, its limit, for every decoder shape,
32 (the probe's limit) for the LM head, against F.linear's 32), so a deterministic verify no
longer re-reads each weight once per 32 rows.

Memory: the prepacked copies sit beside the original weights, which HF's own forward on the same
model object still uses: +1x the decoder and head weights. cpu_gemm.install calls install for a
bf16 model, so it runs wherever the CPU kernels are allowed (`target_worker.cpu_kernel`,
`draft_worker.draft_model.cpu_kernel`); off the CPU, in float32 (the packed kernel's) or with
`cpu_kernel: false`, nothing is prepacked.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

import torch
import torch.nn.functional as F

from specmesh.engine import bf16rows, probecache
from specmesh.engine.rowprobe import _wide, best_s, packing_apply

log = logging.getLogger(__name__)

EQUAL_PROBE_ROWS = 40  # rows up to which a prepacked call is compared with F.linear's (past 32 F.linear
# changes kernel on an AMX Xeon; a prefill step keeps F.linear past the count found)
EQUAL_TRIALS = 4  # random draws per shape
EQUAL_HEAD_TRIALS = 2  # ... for the LM head (a V x H product: each draw costs ~0.5 s)
TIME_REPEATS = 5
_PREFILL: contextvars.ContextVar[bool] = contextvars.ContextVar("specmesh_onednn_prefill", default=False)


def available() -> bool:
    """torch has oneDNN's prepacked linear ops and this CPU runs their bf16 path (oneDNN refuses to
    reorder a bf16 weight without avx512bw/vl/dq or avx_ne_convert: a Zen 3 EPYC, say)."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_is_mkldnn_bf16_supported") and bool(mkldnn._is_mkldnn_bf16_supported()))


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] bf16 -> oneDNN's blocked copy (a one-row batch hint: decode and verify rows)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.detach(), 1)


def bucket(m: int) -> int:
    """The row count a call of m rows runs at: m itself up to 32 (a decode of up to 32 sequences,
    a verify of up to 31 drafts, a 16-node tree, 4 chains of 5), then multiples of 8 to 128, of 16
    to 256, then of 32. oneDNN keeps a primitive per input shape (~0.6 MB each: 299 row counts
    through one 1536x576 weight grew a process by 210 MB on an AMX Xeon), so steps of every row
    count would grow the worker by hundreds of MB; 52 buckets per weight shape up to 256 rows bound
    it (~30 MB per shape). Past ~16 rows a call's time grows with its rows (a Zen 4 EPYC, 1536x576:
    17 rows 188 us, 24 rows 223; 68 rows 624, 96 rows 830), so buckets are narrow: a 16-node
    tree's 17 rows had run at 24 (~12% of its step), 4 trees' 68 at 96."""
    if m <= 32:
        return m
    step = 8 if m <= 128 else 16 if m <= 256 else 32
    return -(-m // step) * step


def run(x: torch.Tensor, wp: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, in] -> [M, out] from a prepacked weight, at bucket(M) rows (zero rows appended; the
    probes run this very call, so a padded call's rows are what they check)."""
    m = x.shape[0]
    pad = bucket(m) - m
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    y = torch.ops.mkldnn._linear_pointwise(x, wp, bias, "none", [], "")
    return y[:m] if pad else y


def equal_rows(weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int = EQUAL_PROBE_ROWS,
               trials: int = EQUAL_TRIALS) -> int:
    """The largest M <= max_rows such that the prepacked call over M' rows (from an aligned and an
    offset start) is bitwise F.linear's over them for every M' <= M, over `trials` draws."""
    found = max_rows
    with torch.no_grad():
        for t in range(trials):
            gen = torch.Generator().manual_seed(1000 + t)
            w = _wide(tuple(weight.shape), weight, gen)
            b = _wide(tuple(bias.shape), bias, gen) if bias is not None else None
            x = _wide((max_rows + 1, weight.shape[1]), weight, gen)
            wp = pack(w)
            for m in range(1, found + 1):
                if not all(torch.equal(run(x[s : s + m], wp, b), F.linear(x[s : s + m], w, b)) for s in (0, 1)):
                    found = m - 1
                    break
            if found == 0:
                break
    return found


def gain(weight: torch.Tensor, bias: torch.Tensor | None) -> float:
    """F.linear's one-row time / the prepacked call's, on the real weight."""
    with torch.no_grad():
        x = torch.randn(1, weight.shape[1]).to(weight.dtype)
        wp = pack(weight)
        return (best_s(lambda: F.linear(x, weight, bias), repeats=TIME_REPEATS)
                / best_s(lambda: run(x, wp, bias), repeats=TIME_REPEATS))


def _kept_equal_rows(weight: torch.Tensor, bias: torch.Tensor | None, trials: int) -> int:
    """equal_rows, from probecache where it ran before on this machine and software."""
    return probecache.cached_for("onednn.equal_rows", weight, bias, lambda: equal_rows(weight, bias, trials=trials),
                                 rows=EQUAL_PROBE_ROWS, trials=trials)


def usable(mod: torch.nn.Linear) -> bool:
    """A bf16 2-D weight on the CPU: what oneDNN's prepacked bf16 call takes."""
    w = mod.weight
    return w.dtype == torch.bfloat16 and w.device.type == "cpu" and w.dim() == 2


def install(model: torch.nn.Module) -> dict[str, dict]:
    """Probe every distinct decoder linear shape and the LM head of a bf16 CPU model; prepack the
    weights of those that pass (module docstring). Returns {shape: {equal_rows, gain, packed}}
    (also kept on the model for logs and bench reports). Idempotent."""
    if getattr(model, "_specmesh_onednn_report", None) is not None:
        return model._specmesh_onednn_report
    if getattr(model, "_specmesh_row_exact", False):  # its counts were probed on F.linear: keep that
        log.warning("oneDNN prepacked linears not installed: rowexact.install ran first")
        return {}
    head = model.get_output_embeddings()
    mods = [m for m in [*model.model.modules(), head] if isinstance(m, torch.nn.Linear) and usable(m)]
    decided: dict[tuple, dict] = {}
    if available():
        for mod in mods:
            w = mod.weight
            key = (tuple(w.shape), w.stride(), mod.bias is not None)
            if key not in decided:
                rows = _kept_equal_rows(w, mod.bias, EQUAL_HEAD_TRIALS if mod is head else EQUAL_TRIALS)
                speed = gain(w, mod.bias) if rows else 0.0
                decided[key] = {"equal_rows": rows, "gain": round(speed, 2), "packed": rows >= 1 and speed >= 1.0}
            if decided[key]["packed"]:
                with torch.no_grad():
                    mod._specmesh_onednn = pack(mod.weight)
                mod._specmesh_onednn_equal = decided[key]["equal_rows"]
    report = {f"{k[0][0]}x{k[0][1]}": v for k, v in decided.items()}
    model._specmesh_onednn_report = report
    if report:
        log.info("oneDNN prepacked bf16 linears: %s", report)
    return report


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the prepacked copies (0 where none), stacks (onednn_stack.Stack) and the bf16 rows
    kernel's copies (bf16rows.py) included."""
    held = [m._specmesh_onednn for m in model.modules() if getattr(m, "_specmesh_onednn", None) is not None]
    held += [st._specmesh_onednn for st in getattr(model, "_specmesh_onednn_stacks", ())]  # onednn_stack.py
    return sum(w.numel() * w.element_size() for w in held) + bf16rows.packed_bytes(model)


@contextlib.contextmanager
def step(prefill: bool):
    """Inside batched_step: whether the step holds a prompt's prefill (then calls past a linear's
    equal_rows keep F.linear)."""
    token = _PREFILL.set(prefill)
    try:
        yield
    finally:
        _PREFILL.reset(token)


def probe_apply():
    """apply(x, W, b) from W prepacked (once per W) for rowexact's probe, which draws its own
    wide-range weights of each shape (full_shape: probe the whole shape, since oneDNN may block by it)."""
    return packing_apply(pack, lambda x, wp, b, w: run(x, wp, b), "onednn prepacked", full_shape=True)


def is_packed(mod: torch.nn.Module) -> bool:
    """Whether install prepacked mod's weight (alone, or inside a Stack)."""
    return getattr(mod, "_specmesh_onednn", None) is not None or getattr(mod, "_specmesh_onednn_part", None) is not None


def is_own(mod: torch.nn.Module) -> bool:
    """Whether mod runs its own prepacked copy (not a Stack's)."""
    return getattr(mod, "_specmesh_onednn", None) is not None


def in_prefill() -> bool:
    """Whether the running step holds a prompt's prefill (step())."""
    return _PREFILL.get()


def _call(mod: torch.nn.Module, x2: torch.Tensor) -> torch.Tensor:
    """mod's prepacked call on x2 [M, in] -> [M, out]: its own copy, or a Stack's call and its columns."""
    part = getattr(mod, "_specmesh_onednn_part", None)
    if part is None:
        return run(x2, mod._specmesh_onednn, mod.bias)
    st, lo, hi = part
    return run(x2, st._specmesh_onednn, st.bias)[:, lo:hi]


def apply_of(mod: torch.nn.Linear):
    """What a deterministic step runs for mod: the prepacked call where installed, else None."""
    return (lambda x, w, b=None: _call(mod, x)) if is_packed(mod) else None


def packed(mod: torch.nn.Linear, x2: torch.Tensor) -> torch.Tensor | None:
    """A default-mode step's call of mod on x2 [M, in] from the prepacked weight, or None where it
    does not apply (not installed, or past equal_rows in a step with a prefill). Callers ask only
    inside a step (cpu_gemm.in_step): HF's own forward keeps F.linear."""
    if not is_packed(mod) or x2.dtype != torch.bfloat16:
        return None
    if _PREFILL.get() and x2.shape[0] > mod._specmesh_onednn_equal:
        return None
    y = bf16rows.call(mod, x2, _PREFILL.get())  # the rows kernel where it serves (bf16rows.route)
    return _call(mod, x2) if y is None else y


class PrepackedLinear(torch.nn.Linear):
    """A bf16 CPU nn.Linear that runs from oneDNN's prepacked copy of its weight, every row count
    (bucketed: run). For drafters only, whose output need not be bitwise F.linear's: a draft is
    verified whatever it is, and at T > 0 its q is computed from these very logits."""

    _specmesh_onednn: torch.Tensor

    @classmethod
    def of(cls, mod: torch.nn.Linear) -> "PrepackedLinear":
        """A copy of mod sharing its weight (and bias) tensors, plus the prepacked weight (+1x bytes)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.in_features, new.out_features = mod.in_features, mod.out_features
        new.weight, new.bias = mod.weight, mod.bias
        with torch.no_grad():
            new._specmesh_onednn = pack(mod.weight)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] bf16 -> [..., out]."""
        y = run(x.reshape(-1, x.shape[-1]), self._specmesh_onednn, self.bias)  # [M, out]
        return y.reshape(*x.shape[:-1], y.shape[-1])


def prepack_children(module: torch.nn.Module) -> int:
    """Replace every bf16 CPU nn.Linear below module by its PrepackedLinear (same parameters, same
    state_dict keys); the number replaced, 0 where oneDNN's bf16 path is unavailable."""
    if not available():
        return 0
    swaps = [(parent, name, child) for parent in module.modules() for name, child in parent.named_children()
             if type(child) is torch.nn.Linear and usable(child)]
    for parent, name, child in swaps:
        setattr(parent, name, PrepackedLinear.of(child))
    return len(swaps)
