"""bf16 linears of a decode or verify step from a kernel that reads each weight once for every
row (csrc/bf16_rows.cpp), where start-up probes find it faster than oneDNN's prepacked call and,
for the rows that must be HF's arithmetic, bitwise oneDNN's one-row call.

Why: on a CPU with AVX512-BF16 but no AMX, oneDNN streams a weight once for a one-token step but
runs a few rows far below what the memory allows. Measured on a 2-core Intel Xeon (family 6 model
207, AMX not exposed), one thread, SmolLM2-135M's weights streamed once, ms for 1 / 5 / 9 rows:
oneDNN 25.9 / 30.2 / 41.7, the kernel 21.4 / 24.1 / 29.0. A verify round's rows cost what a
decode step's one does.

Bitwise one-row: oneDNN's brgemm sums a one-row bf16 call in K blocks: each block's VDPBF16PS
chains from 0, the blocks added in order in float32 (found on a 2-core Zen 4 EPYC, torch 2.13:
blocks of 512, for every SmolLM2 shape, the 49152x576 head included; a one-chain kernel differs
in some element on 20-60% of wide-range draws). The kernel takes the block as an argument (kc, in
k-pairs), so each row it computes is that call's bits whatever the row count. `exact_chunk`
probes candidate blocks against oneDNN's one-row calls (rows 1-17, aligned and offset,
rowprobe._wide draws of every shape) and keeps the first that matches all (probecache keeps it);
none: one chain, not exact. Exact, the kernel also serves:

* the lone row of a default-mode step (the mesh's AR: still HF `generate`'s bits), where faster
  than oneDNN's one-row call (the LM head too: a copy of its own, lone rows only);
* every row of a deterministic step (rowexact) but a prefill's: each row is then the one-row
  call's, so the down projection (whose batched oneDNN rows are not) needs no per-row calls.

It serves default-mode steps of 2-32 rows (up to WIDE_MAX_ROWS where it is faster at WIDE_ROWS
too): exact, whatever the timing probe says (a verify's
rows are then the one-row step's bits); not exact, only where that probe finds it faster at 5
and 9 rows (rows then may differ from the one-row step in the last bit, as batched rows already
may: `batch_invariant: false`). Never a prefill (a prompt's KV is HF's multi-row call).
`target_worker.bf16_rows`: auto (the probes), true (wherever it builds; exactness still
probed), false.

Memory: a copy of each decoder weight beside oneDNN's (+1x the decoder's linears: 212 MB for
SmolLM2-135M; +57 MB for the head where it serves lone rows); stacks (onednn_stack.Stack) take
their members' copies over, as for oneDNN's.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import torch

from specmesh.engine import probecache
from specmesh.engine.rowprobe import _wide

log = logging.getLogger(__name__)

MIN_ROWS, MAX_ROWS = 2, 32  # default-mode calls of this many rows take the kernel where faster
# ... and up to WIDE_MAX_ROWS where the probe finds it faster at WIDE_ROWS too (a Zen 4 EPYC,
# SmolLM2's decoder linears streamed once: 36 / 80 / 128 rows 36.6 / 85.2 / 137.8 ms against
# oneDNN's 56.0 / 93.8 / 156.4; batches of verifies: 4 x 9 rows, 16 x 5)
WIDE_ROWS, WIDE_MAX_ROWS = 64, 256
PROBE_ROWS = (1, 5, 9, WIDE_ROWS)  # the timing probe: a one-token step, a verify of 4 and of 8 drafts, a batch
PROBE_REPEATS = 5  # timed passes of each path per row count, interleaved (_probe)
CHUNKS = (256, 0, 128, 512, 64, 384)  # candidate K blocks in k-pairs (0: one chain), first the Zen 4's
EXACT_ROWS = (1, 2, 5, 9, 17)  # row counts exact_chunk compares, from an aligned and an offset start
EXACT_TRIALS = 2
ENABLED = True  # False: every call keeps oneDNN's (bench/bf16rows_ab.py's A/B)
_SETTING: bool | str = "auto"
_EXT = None  # the CPU kernels' extension (cpu_gemm.load), set by install


class Use(NamedTuple):
    """Where a kernel copy serves: kc its K block (k-pairs, 0: one chain); exact: its rows are
    oneDNN's one-row call's bits; lone: a default-mode call of one row; batched: default-mode calls
    of MIN_ROWS..max_rows rows; det_rows: the most rows a deterministic call takes it for."""
    kc: int
    exact: bool
    lone: bool
    batched: bool
    det_rows: int
    max_rows: int = MAX_ROWS


def configure(setting: bool | str) -> None:
    """target_worker.bf16_rows: "auto" (probe), True (wherever it builds), False."""
    global _SETTING
    _SETTING = setting


def route(mod, rows: int, prefill: bool, det: bool = False) -> tuple[object, int, tuple | None] | None:
    """(owner, kc, columns or None) where a call of `rows` rows of mod takes the kernel, else None:
    the owner holds the copy (`_specmesh_bf16rows`) and the bias, mod itself or (a stack member)
    its stack, whose columns cols are mod's. det: inside a deterministic step."""
    owner, cols = mod, None
    if getattr(mod, "_specmesh_bf16rows", None) is None:
        part = getattr(mod, "_specmesh_onednn_part", None)
        if part is None:
            return None
        owner, cols = part[0], part[1:]
    wp, use = getattr(owner, "_specmesh_bf16rows", None), getattr(owner, "_specmesh_bf16rows_use", None)
    if wp is None or use is None or prefill or not ENABLED:
        return None
    if det:
        ok = use.exact and rows <= use.det_rows
    else:
        ok = use.lone if rows == 1 else use.batched and MIN_ROWS <= rows <= use.max_rows
    return (owner, use.kc, cols) if ok else None


def call(mod, x2: torch.Tensor, prefill: bool, det: bool = False) -> torch.Tensor | None:
    """mod(x2) for x2 [M, in] bf16 from its kernel copy where route() sends it, else None."""
    r = route(mod, x2.shape[0], prefill, det)
    if r is None:
        return None
    owner, kc, cols = r
    y = _EXT.bf16_rows(x2, owner._specmesh_bf16rows, owner.bias, kc)  # [M, out]
    return y if cols is None else y[:, cols[0]:cols[1]]


def stack(st, mods: list[torch.nn.Linear]) -> None:
    """A Stack over mods takes their kernel copies over (one copy of the stacked weight), where
    every member has one; else the members keep their own."""
    st._specmesh_bf16rows = None
    if not mods or any(getattr(m, "_specmesh_bf16rows", None) is None for m in mods):
        return
    # panel pairs are whole 32-column blocks: the members' copies, stacked, are the stack's packing
    st._specmesh_bf16rows = torch.cat([m._specmesh_bf16rows for m in mods])
    st._specmesh_bf16rows_use = mods[0]._specmesh_bf16rows_use
    for m in mods:
        m._specmesh_bf16rows = None


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the kernel copies (0 where none), stacks' included."""
    held = [m._specmesh_bf16rows for m in model.modules() if getattr(m, "_specmesh_bf16rows", None) is not None]
    held += [st._specmesh_bf16rows for st in getattr(model, "_specmesh_onednn_stacks", ())
             if getattr(st, "_specmesh_bf16rows", None) is not None]
    return sum(w.numel() * w.element_size() for w in held)


def install(model: torch.nn.Module, ext, onednn_run, pack) -> dict:
    """Pack the decoder's oneDNN-prepacked linears (and, where exact and faster for a lone row,
    the LM head) for the kernel where the setting and the probes allow; returns the decision
    ({"used", "exact", "kc", "lone", "rows", "onednn_ms", "kernel_ms", "head"} or {"used": False,
    "why"}), also kept on the model. ext: the CPU kernels' extension (None: not built);
    onednn_run, pack: onednn.run and onednn.pack, what the probes compare the kernel with. After
    onednn.install, before any stack is built. Idempotent."""
    global _EXT
    done = getattr(model, "_specmesh_bf16rows_report", None)
    if done is not None:
        return done
    if ext is not None:
        _EXT = ext
    report = _decide(model, ext, onednn_run, pack)
    model._specmesh_bf16rows_report = report
    log.info("bf16 rows kernel for decode and verify linears (bf16_rows %s): %s", _SETTING, report)
    return report


def _linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.model.modules() if _fits(m)]


def _fits(m) -> bool:
    return (isinstance(m, torch.nn.Linear) and getattr(m, "_specmesh_onednn", None) is not None
            and m.out_features % 32 == 0 and m.in_features % 2 == 0)


def _decide(model: torch.nn.Module, ext, onednn_run, pack) -> dict:
    if _SETTING is False:
        return {"used": False, "why": "bf16_rows false"}
    if ext is None or not ext.bf16_rows_built():
        return {"used": False, "why": "no AVX512-BF16 build of the CPU kernels"}
    mods = _linears(model)
    if not mods:
        return {"used": False, "why": "no oneDNN-prepacked bf16 decoder linears"}
    head = model.get_output_embeddings()
    kc = exact_chunk(mods + ([head] if _fits(head) else []), ext, onednn_run, pack)
    with torch.no_grad():
        for m in mods:
            m._specmesh_bf16rows = ext.bf16_pack(m.weight.detach())
    onednn_ms, kernel_ms = _probe(mods, ext, onednn_run, kc or 0)
    faster = _faster(onednn_ms, kernel_ms)
    # exact: batched rows take it too (a verify's rows are then the one-row step's; at 5 / 9 rows it
    # and oneDNN trade places between starts on a Zen 4: 10.0 / 16.7 against 13.8 / 16.8 ms, then
    # 14.0 / 22.1 against 16.6 / 21.5)
    used = _SETTING is True or kc is not None or all(faster[1:3])
    exact = kc is not None
    use = Use(kc or 0, exact, exact and (_SETTING is True or faster[0]), used, 1 << 30 if exact else 0,
              _max_rows(faster))
    for m in mods:
        m._specmesh_bf16rows_use = use
        if not (use.batched or use.exact):
            m._specmesh_bf16rows = None
    report = {"used": used, "exact": use.exact, "kc": use.kc, "lone": use.lone, "max_rows": use.max_rows,
              "rows": list(PROBE_ROWS), "onednn_ms": onednn_ms, "kernel_ms": kernel_ms}
    if use.exact and _fits(head):
        report["head"] = _decide_head(head, ext, onednn_run, use.kc)
    return report


def _decide_head(head: torch.nn.Linear, ext, onednn_run, kc: int) -> dict:
    """The LM head's copy (bitwise oneDNN's one-row call: exact_chunk probed the head's shape
    too) for lone rows where its one-row call beats oneDNN's, and for batched and deterministic
    calls where its 5- and 9-row calls beat oneDNN's too (a verify's logits then read the head
    once, as the one-token step does: on a Zen 4 EPYC 49152 x 576 at 5 / 9 / 16 rows, oneDNN 3.7 /
    4.5 / 6.5 ms, the kernel 3.0 / 2.5 / 4.5), up to WIDE_MAX_ROWS where its WIDE_ROWS call does
    too; ms of each, the best of PROBE_REPEATS."""
    with torch.no_grad():
        head._specmesh_bf16rows = ext.bf16_pack(head.weight.detach())  # _probe times it from here
    onednn_ms, kernel_ms = _probe([head], ext, onednn_run, kc)
    faster = _faster(onednn_ms, kernel_ms)
    lone = _SETTING is True or faster[0]
    batched = _SETTING is True or all(faster[1:3])
    if lone or batched:
        head._specmesh_bf16rows_use = Use(kc, True, lone, batched, 1 << 30 if batched else 1, _max_rows(faster))
    else:
        head._specmesh_bf16rows = None
    return {"lone": lone, "batched": batched, "max_rows": _max_rows(faster), "onednn_ms": onednn_ms,
            "kernel_ms": kernel_ms}


def _faster(onednn_ms: list[float], kernel_ms: list[float]) -> list[bool]:
    """Per PROBE_ROWS row count, whether the kernel beat oneDNN."""
    return [k < o for o, k in zip(onednn_ms, kernel_ms)]


def _max_rows(faster: list[bool]) -> int:
    """The most rows a default-mode call takes the kernel for: WIDE_MAX_ROWS where it won at WIDE_ROWS."""
    return WIDE_MAX_ROWS if faster[PROBE_ROWS.index(WIDE_ROWS)] else MAX_ROWS


def exact_chunk(mods: list[torch.nn.Linear], ext, onednn_run, pack) -> int | None:
    """The first of CHUNKS whose kernel rows equal oneDNN's one-row calls bitwise for every
    distinct (shape, bias) of mods (module docstring), else None. Kept by probecache."""
    shapes = sorted({(m.out_features, m.in_features, m.bias is not None) for m in mods})
    like = mods[0].weight
    args = {"shapes": [list(s) for s in shapes], "chunks": list(CHUNKS), "rows": list(EXACT_ROWS),
            "trials": EXACT_TRIALS, "dtype": str(like.dtype)}
    found = probecache.cached("bf16rows.exact_chunk", args, like.device,
                              lambda: _exact_probe(shapes, like, ext, onednn_run, pack))
    return None if found is None else int(found)


def _exact_probe(shapes, like: torch.Tensor, ext, onednn_run, pack) -> int | None:
    alive = list(CHUNKS)
    with torch.no_grad():
        for out, inp, has_bias in shapes:
            for t in range(EXACT_TRIALS):
                gen = torch.Generator().manual_seed(3000 + t)
                w = _wide((out, inp), like, gen)
                b = _wide((out,), like, gen) if has_bias else None
                x = _wide((max(EXACT_ROWS) + 1, inp), like, gen)
                wo, wk = pack(w), ext.bf16_pack(w)
                one = torch.cat([onednn_run(x[i : i + 1], wo, b) for i in range(x.shape[0])])  # [R, out]
                alive = [kc for kc in alive if all(torch.equal(ext.bf16_rows(x[s : s + m], wk, b, kc), one[s : s + m])
                                                   for m in EXACT_ROWS for s in (0, 1))]
                if not alive:
                    return None
    return alive[0]


def _race(paths) -> list[float]:
    """Seconds of each path, the best of PROBE_REPEATS, passes alternated (oneDNN, kernel, kernel,
    oneDNN, ...): on a shared VM whose speed drifts +-10% and more within a minute, timing one
    path's passes after the other's let a slow spell decide (a Zen 4 EPYC, session 38: kernel
    13.5 / 20.5 ms against oneDNN 17.1 / 22.0 at one start, 21.5 / 22.2 against 18.9 / 21.2 at the
    next, in a slow spell). The first round warms oneDNN's primitives and the caches."""
    best = [float("inf")] * len(paths)
    for r in range(PROBE_REPEATS + 1):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            t0 = time.perf_counter()
            paths[i]()
            if r:
                best[i] = min(best[i], time.perf_counter() - t0)
    return best


def _probe(mods: list[torch.nn.Linear], ext, onednn_run, kc: int) -> tuple[list[float], list[float]]:
    """ms of one pass over every decoder linear (as a step streams them) at PROBE_ROWS rows:
    oneDNN's prepacked calls and the kernel's (block kc), the best of PROBE_REPEATS passes each."""
    gen = torch.Generator().manual_seed(0)
    out: tuple[list[float], list[float]] = ([], [])
    for rows in PROBE_ROWS:
        xs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {m.in_features for m in mods}}
        best = _race((lambda: [onednn_run(xs[m.in_features], m._specmesh_onednn, m.bias) for m in mods],
                      lambda: [ext.bf16_rows(xs[m.in_features], m._specmesh_bf16rows, m.bias, kc) for m in mods]))
        for i in (0, 1):
            out[i].append(round(best[i] * 1e3, 2))
    return out
