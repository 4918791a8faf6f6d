"""Deterministic chain rows in groups: how many of a verify's rows one SDPA call may take.

The deterministic mode computes each verified row as the one-token step that later sees the same
slots computes it: torch's SDPA over exactly those slots (csrc/sdpa_rows.cpp). One call per row
and layer costs a call's fixed work each time (~20 us of a ~24 us bf16 row at 256 slots on a
2-core AMX Xeon). torch's CPU kernel computes every batch entry and head alone, with the path
its one-row query takes, so consecutive chain rows can be one call's batch entries: each over
the slots of the group's last row, the slots past its own masked. The masked slots add exact
zeros, and the kernel's vector loops over the slots split them where the row's own call splits
them when the two slot counts share floor(count / vector width). So rows grouped by
floor(slots / width) are bitwise their own calls, for a width that matches the kernel's vectors.

That is a property of torch's kernel on this CPU (its vector width, its tail loops), so it is
probed, never assumed: `width` tries WIDTHS (16 only since session 31), against the one-call-per-row loop on
draws that round apart under any other order (a wide-range value per slot), at every slot count
to 639 and across the kernel's 512- and 1024-slot edges, and keeps the first that is bitwise everywhere (0:
none, one call per row). Decided once per shape, logged, kept by the probe cache. GPUs keep one
call per row (kv._rows_exact's loop). A tree goes in chains: one root-to-node path copied after
the cache serves every row on it, each over the cache and its own prefix of the path, grouped the
same way.
"""

from __future__ import annotations

import logging
import threading

import torch

from specmesh.engine import cpu_gemm, probecache
from specmesh.engine.rowprobe import _wide

log = logging.getLogger(__name__)

ENABLED = True  # False: one call per row (A/B and tests)
# AVX-512's float vector. Not 8 (AVX2's): on a Zen 3 EPYC, bf16, 8 passed this probe while a wider
# sweep (tests/unit/test_rowgroup.py: 40 cached slots, 5 rows, folded 9x3x64) found a row that
# differs from its own call (session 31); such CPUs keep one call per row until that is understood
WIDTHS = (16,)
# cached slots of the probe's verifies, one draw each. Many, not a few: on a Zen 4 EPYC (bf16,
# avx512_bf16 without AMX) width 16 differs from the one-row calls in one output element of ~1% of
# 17-row draws (a rounding that bf16's output hides otherwise); 39 draws passed there, the test's
# sweep then failed (session 32). 680 draws miss a 1% rate with odds of ~1 in 1,000; the probe
# stops at its first difference and its result is kept (probecache), so a CPU pays it once.
PROBE_LENGTHS = tuple(range(640)) + tuple(range(1008, 1048))
PROBE_ROWS = 17  # rows per probe verify: every position of a 16-row group, and one past it

_WIDTH: dict[tuple, int] = {}
_LOCK = threading.Lock()
_NO_PATH = torch.empty(0, dtype=torch.long)


def width(device, dtype, heads: int, kv_heads: int, d: int, scale, fold: bool) -> int:
    """The group width for deterministic chain rows of this shape (0: one call per row)."""
    if not ENABLED or torch.device(device).type != "cpu":
        return 0
    key = (dtype, heads, kv_heads, d, scale, fold)
    found = _WIDTH.get(key)  # every layer of every deterministic step asks: decided ones skip the lock
    if found is not None:
        return found
    with _LOCK:
        if key not in _WIDTH:
            ext = cpu_gemm.load()
            args = {"dtype": str(dtype), "heads": heads, "kv_heads": kv_heads, "d": d, "scale": scale, "fold": fold,
                    "lengths": PROBE_LENGTHS, "rows": PROBE_ROWS, "widths": WIDTHS}
            _WIDTH[key] = 0 if ext is None else probecache.cached(
                "rowgroup.width", args, "cpu", lambda: _probe(ext, dtype, heads, kv_heads, d, scale, fold))
            log.info("deterministic chain rows %s: %s", key, f"grouped by floor(slots / {_WIDTH[key]})"
                     if _WIDTH[key] else "one SDPA call per row (no group width is bitwise here)")
        return _WIDTH[key]


def _probe(ext, dtype, heads: int, kv_heads: int, d: int, scale, fold: bool) -> int:
    with torch.inference_mode():
        for w in WIDTHS:
            if all(_equal(ext, w, length, dtype, heads, kv_heads, d, scale, fold) for length in PROBE_LENGTHS):
                return w
    return 0


def _equal(ext, w: int, length: int, dtype, heads: int, kv_heads: int, d: int, scale, fold: bool) -> bool:
    """One probe verify of PROBE_ROWS chain rows past `length` cached slots, grouped by w and one
    call per row, in the engine's layouts (queries a transposed [1, T, H, D], keys and values a
    pool layer's view); bitwise equal or not."""
    n = PROBE_ROWS
    gen = torch.Generator().manual_seed(length)
    q = (torch.randn(1, n, heads, d, generator=gen) * 2).to(dtype).transpose(1, 2)  # [1, H, n, D]
    k = (torch.randn(kv_heads, length + n + 3, d, generator=gen) * 2).to(dtype)  # a pool layer [KV, S, D]
    v = _wide((kv_heads * (length + n + 3), d), torch.empty(0, dtype=dtype), gen).reshape(kv_heads, -1, d)
    ks, vs = k[None, :, 2 : 2 + length + n], v[None, :, 2 : 2 + length + n]  # [1, KV, L + n, D] in place
    outs = []
    for group in (w, 0):
        out = torch.empty(n, heads, d, dtype=dtype)
        ext.sdpa_rows(q, ks, vs, length, _NO_PATH, _NO_PATH, scale, fold, group, out)
        outs.append(out)
    return torch.equal(outs[0], outs[1])
