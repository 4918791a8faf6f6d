"""bf16 decoder linears of 2-32 rows from a kernel that reads each weight once for every row
(csrc/bf16_rows.cpp), in default-mode (batched) steps, where a start-up probe finds it faster than
oneDNN's prepacked call.

Why: on a CPU with AVX512-BF16 but no AMX, oneDNN streams a weight once for a one-token step but
runs a few rows far below what the memory allows. Measured on a 2-core Intel Xeon (family 6 model
207, AMX not exposed), one thread, SmolLM2-135M's weights streamed once, ms for 1 / 5 / 9 rows:
oneDNN 25.9 / 30.2 / 41.7, the kernel 21.4 / 24.1 / 29.0. A verify round's rows cost what a
decode step's one does.

Where: only in default-mode steps without a prompt's prefill, and never for a lone row, so the
mesh's AR (one row a step) stays bitwise oneDNN's, i.e. HF's (onednn.py), and a deterministic
step (rowexact) never runs it. The kernel is row-invariant (each output one float32 chain over k
in order), but its sums are not oneDNN's: batched rows may differ from the one-row step in the last
bit, as batched rows already may (`batch_invariant: false`). The LM head keeps oneDNN (compute-
bound at 5+ rows on either). `target_worker.bf16_rows`: auto (the probe), true, false.

Memory: a copy of each decoder weight beside oneDNN's (+1x the decoder's linears: 212 MB for
SmolLM2-135M); stacks (onednn_stack.Stack) take their members' copies over, as for oneDNN's.
"""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)

MIN_ROWS, MAX_ROWS = 2, 32  # a call of this many rows takes the kernel (a lone row: oneDNN's, HF's)
PROBE_ROWS = (5, 9)  # the probe times a verify of 4 and of 8 drafts
PROBE_REPEATS = 5  # timed passes of each path per row count, interleaved (_probe)
_SETTING: bool | str = "auto"
_EXT = None  # the CPU kernels' extension (cpu_gemm.load), set by install


def configure(setting: bool | str) -> None:
    """target_worker.bf16_rows: "auto" (probe), True (wherever it builds), False."""
    global _SETTING
    _SETTING = setting


def applies(rows: int, prefill: bool) -> bool:
    """Whether a default-mode call of `rows` rows takes the kernel (never a lone row, never in a
    step that holds a prompt's prefill)."""
    return MIN_ROWS <= rows <= MAX_ROWS and not prefill


def call(mod, x2: torch.Tensor) -> torch.Tensor | None:
    """mod(x2) for x2 [M, in] bf16 from its kernel copy (a stack member: the stack's, its
    columns), or None where it has none."""
    owner, cols = mod, None
    if getattr(mod, "_specmesh_bf16rows", None) is None:
        part = getattr(mod, "_specmesh_onednn_part", None)
        if part is None:
            return None
        owner, cols = part[0], part[1:]
    wp = getattr(owner, "_specmesh_bf16rows", None)
    if wp is None:
        return None
    y = _EXT.bf16_rows(x2, wp, owner.bias)  # [M, out]
    return y if cols is None else y[:, cols[0]:cols[1]]


def stack(st, mods: list[torch.nn.Linear]) -> None:
    """A Stack over mods takes their kernel copies over (one copy of the stacked weight), where
    every member has one; else the members keep their own."""
    st._specmesh_bf16rows = None
    if not mods or any(getattr(m, "_specmesh_bf16rows", None) is None for m in mods):
        return
    # panel pairs are whole 32-column blocks: the members' copies, stacked, are the stack's packing
    st._specmesh_bf16rows = torch.cat([m._specmesh_bf16rows for m in mods])
    for m in mods:
        m._specmesh_bf16rows = None


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the kernel copies (0 where none), stacks' included."""
    held = [m._specmesh_bf16rows for m in model.modules() if getattr(m, "_specmesh_bf16rows", None) is not None]
    held += [st._specmesh_bf16rows for st in getattr(model, "_specmesh_onednn_stacks", ())
             if getattr(st, "_specmesh_bf16rows", None) is not None]
    return sum(w.numel() * w.element_size() for w in held)


def install(model: torch.nn.Module, ext, onednn_run) -> dict:
    """Pack the decoder's oneDNN-prepacked linears for the kernel where the setting and the probe
    allow; returns the decision ({"used", "onednn_ms", "kernel_ms"} or {"used": False, "why"}),
    also kept on the model. ext: the CPU kernels' extension (None: not built); onednn_run:
    onednn.run, what the probe times the kernel against. After onednn.install, before any stack
    is built. Idempotent."""
    global _EXT
    done = getattr(model, "_specmesh_bf16rows_report", None)
    if done is not None:
        return done
    if ext is not None:
        _EXT = ext
    report = _decide(model, ext, onednn_run)
    model._specmesh_bf16rows_report = report
    log.info("bf16 rows kernel for batched decoder linears (bf16_rows %s): %s", _SETTING, report)
    return report


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.model.modules() if isinstance(m, torch.nn.Linear)
            and getattr(m, "_specmesh_onednn", None) is not None
            and m.out_features % 32 == 0 and m.in_features % 2 == 0]


def _decide(model: torch.nn.Module, ext, onednn_run) -> dict:
    if _SETTING is False:
        return {"used": False, "why": "bf16_rows false"}
    if ext is None or not ext.bf16_rows_built():
        return {"used": False, "why": "no AVX512-BF16 build of the CPU kernels"}
    mods = _linears(model)
    if not mods:
        return {"used": False, "why": "no oneDNN-prepacked bf16 decoder linears"}
    with torch.no_grad():
        for m in mods:
            m._specmesh_bf16rows = ext.bf16_pack(m.weight.detach())
    if _SETTING is True:
        return {"used": True, "why": "bf16_rows true"}
    onednn_ms, kernel_ms = _probe(mods, ext, onednn_run)
    used = all(k < o for o, k in zip(onednn_ms, kernel_ms))
    if not used:
        for m in mods:
            m._specmesh_bf16rows = None
    return {"used": used, "rows": list(PROBE_ROWS), "onednn_ms": onednn_ms, "kernel_ms": kernel_ms}


def _probe(mods: list[torch.nn.Linear], ext, onednn_run) -> tuple[list[float], list[float]]:
    """ms of one pass over every decoder linear (as a step streams them) at PROBE_ROWS rows:
    oneDNN's prepacked calls and the kernel's, the best of PROBE_REPEATS passes each. The two
    paths' passes alternate (oneDNN, kernel, kernel, oneDNN, ...): on a shared VM whose speed
    drifts +-10% and more within a minute, timing one path's passes after the other's let a slow
    spell decide (a Zen 4 EPYC, session 38: kernel 13.5 / 20.5 ms against oneDNN 17.1 / 22.0 at
    one start, 21.5 / 22.2 against 18.9 / 21.2 at the next, in a slow spell)."""
    gen = torch.Generator().manual_seed(0)
    out: tuple[list[float], list[float]] = ([], [])
    for rows in PROBE_ROWS:
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {m.in_features for m in mods}}
        paths = (lambda m: onednn_run(xs[m.in_features], m._specmesh_onednn, m.bias),
                 lambda m: ext.bf16_rows(xs[m.in_features], m._specmesh_bf16rows, m.bias))
        best = [float("inf"), float("inf")]
        for r in range(PROBE_REPEATS + 1):  # the first round warms oneDNN's primitives and the caches
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                for m in mods:
                    paths[i](m)
                if r:
                    best[i] = min(best[i], time.perf_counter() - t0)
        for i in (0, 1):
            out[i].append(round(best[i] * 1e3, 2))
    return out
