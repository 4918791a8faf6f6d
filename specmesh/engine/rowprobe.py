"""The deterministic-step switch and the probe's primitives, shared by rowexact (linears, the LM
head) and rownorm (norms): rows(mode) marks the steps inside as row-exact; invariant_rows finds
how many rows a batched call may hold and still equal its one-row calls bit for bit, on
wide-range data (_wide) that shows any other summation order through the output's rounding."""

from __future__ import annotations

import contextlib
import contextvars
import time

import torch

_ACTIVE: contextvars.ContextVar[int] = contextvars.ContextVar("specmesh_row_exact", default=0)  # 0 / 1 / 2 (floor)

PROBE_ROWS = 64  # largest batched row count probed for the decoder's linears
PROBE_PACKED_ROWS = 128  # ... for a linear a step runs from oneDNN's prepacked weight (onednn.py): 16 x 5 rows fit
PROBE_HEAD_ROWS = 32  # ... and for the LM head (a bigger GEMM: V x H)
PROBE_TRIALS = 12  # random draws per linear shape; the smallest count found wins
PROBE_HEAD_TRIALS = 6  # ... for the LM head (each draw costs ~0.5 s there)
KERNEL_PROBE_OUT = 96  # output columns a probe of the packed kernel draws (6 panels, odd pairs and tails)

@contextlib.contextmanager
def rows(active: bool | int):
    """Steps inside run row-exact: 0 / False off, 1 / True HF's one-row kernels, 2 the 2-row floor
    where install found it (rowexact's docstring)."""
    token = _ACTIVE.set(int(active))
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


def pow2_floor(n: int) -> int:
    """n rounded down to a power of two (0 stays 0): a probed row count as steps use it."""
    return 1 << (n.bit_length() - 1) if n > 0 else 0


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


def packing_apply(pack, run, kind: str, full_shape: bool = False):
    """apply(x, W, b=None) for a probe that draws its own wide-range weights of each shape: each W
    packed once by pack(W) (the last one kept), then run(x, packed, b, W). kind names the kernel
    (probecache keys by it); full_shape: the probe must draw the whole shape (a kernel may block by it)."""
    held: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def apply(x, w, b=None):
        if id(w) not in held:
            held.clear()
            held[id(w)] = (w, pack(w))
        return run(x, held[id(w)][1], b, w)

    apply.full_shape = full_shape
    apply.kind = kind
    return apply


def best_s(fn, device="cpu", repeats: int = 5) -> float:
    """Fastest of `repeats` timed calls of fn (after one untimed), in seconds; a GPU synchronised
    around each (the speed probes of attention.py and onednn.py)."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    fn()
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best
