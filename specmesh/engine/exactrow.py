"""A one-token bf16 row's attention from csrc/exact_row.cpp: HF's SDPA call's arithmetic, bit for bit
where a start-up probe finds it so, without that call's cost.

Why: the lone one-token step keeps HF's SDPA call (one query row, enable_gqa) so that the mesh's AR
is HF `generate`'s bit for bit (attention.py). On a CPU whose BLAS takes a generic path that call
is slow: on a 2-core AMD EPYC (Zen 5, avx512_bf16, no AMX), torch 2.13, one thread, SmolLM2-135M's
shape (9 heads, 3 kv heads, D 64), 184 us at 256 slots and 1.78 ms at 2,200 (perf: mostly MKL's
default bf16 gemv); the kernel 11 and 97-103 us. A 2,200-token decode step there cost 4x a
60-token one, nearly all of it this call. The deterministic mode's verify rows are one-token
steps too (kv._rows_exact), so they take it as well.

The kernel reproduces the order torch's CPU flash kernel and its BLAS used on that machine
(exact_row.cpp says which). That is a property of the CPU, the BLAS, the thread count and the
torch build, so it is probed here, never assumed: `ok` compares the kernel with HF's call on
draws that round apart under any other order (wide-range values, and scores spread so the softmax
weighs many slots) at every slot count that changes the kernel's loops (vector tails, 512-slot
blocks), and each head's logsumexp with the flash op's own (which shows the softmax sum's last
bits, most of all in a draw whose max score is 0: _sum_draw), and keeps the kernel only where all of it is equal and the kernel is faster. Decided once
per shape and logged; `ENABLED = False` turns it off (A/B runs, tests).
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F

from specmesh.engine.rowprobe import _wide, best_s

log = logging.getLogger(__name__)

ENABLED = True
PROBE_LENGTHS = (1, 2, 3, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 100, 255, 511, 512, 513, 528, 700, 1023,
                 1024, 1025, 1100, 1600)
PROBE_DRAWS = 3  # per length: spreads 0.5, 1.5, 2.5 (scores a few units to tens: a flat to a peaked softmax)
TIME_LENGTH = 1024
TIME_REPEATS = 5

_OK: dict[tuple, bool] = {}
_LOCK = threading.Lock()
_EXT: list = []  # the extension, once found built with the kernel


def _ext():
    if not _EXT:
        from specmesh.engine import cpu_gemm

        ext = cpu_gemm.load()
        if ext is not None and hasattr(ext, "exact_row") and ext.exact_row_built():
            _EXT.append(ext)
    return _EXT[0] if _EXT else None


def _hf_call(q, k, v, scale):
    return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _equal(ext, heads: int, kv_heads: int, d: int, scale) -> bool:
    """The kernel's output and logsumexp against HF's call and the flash op's on every probe draw."""
    gen = torch.Generator().manual_seed(0)
    like = torch.empty(0, dtype=torch.bfloat16)
    group = heads // kv_heads
    for length in PROBE_LENGTHS:
        for draw in range(PROBE_DRAWS + 1):
            spread = 0.5 + draw
            q = (torch.randn(1, heads, 1, d, generator=gen) * spread).bfloat16()
            k = (torch.randn(1, kv_heads, length, d, generator=gen) * spread).bfloat16()
            if draw == PROBE_DRAWS:
                q, k = _sum_draw(gen, heads, kv_heads, length, d)
            v = _wide((kv_heads * length, d), like, gen).reshape(1, kv_heads, length, d)
            lse = torch.empty(heads, dtype=torch.float32)
            if not torch.equal(ext.exact_row(q, k, v, scale, lse), _hf_call(q, k, v, scale)):
                return False
            ref = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), 0.0, False, attn_mask=None,
                scale=scale)[1]
            if not torch.equal(lse, ref.reshape(heads)):
                return False
    return True


def _sum_draw(gen, heads: int, kv_heads: int, length: int, d: int):
    """Scores whose max is exactly 0 (slot 0's key is zero, the others' scores -0.25 .. -5.25), so the
    logsumexp is log(sum) alone, a few units at most: a sum one ulp apart shows in its last bits far
    more often than under a max of tens (how torch's 32-at-a-time sum was found)."""
    q = torch.zeros(1, heads, 1, d)
    q[..., 0] = 1.0
    k = torch.zeros(1, kv_heads, length, d)
    k[:, :, 1:, 0] = -(torch.rand(kv_heads, length - 1, generator=gen) * 40 + 2) / d**-0.5 / 8
    return q.bfloat16(), k.bfloat16()


def _gain(ext, heads: int, kv_heads: int, d: int, scale) -> float:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, heads, 1, d, generator=gen).bfloat16()
    k, v = (torch.randn(1, kv_heads, TIME_LENGTH, d, generator=gen).bfloat16() for _ in range(2))
    return best_s(lambda: _hf_call(q, k, v, scale), "cpu", TIME_REPEATS) / best_s(
        lambda: ext.exact_row(q, k, v, scale, None), "cpu", TIME_REPEATS)


def ok(device, dtype, heads: int, kv_heads: int, d: int, scale) -> bool:
    """Whether one-token rows of this shape take the kernel (decided once per shape, then cached)."""
    if not ENABLED or dtype != torch.bfloat16 or torch.device(device).type != "cpu" or heads % kv_heads or d % 16 \
            or d > 256:
        return False
    key = (heads, kv_heads, d, scale)
    decided = _OK.get(key)  # every one-token row of every layer asks: decided ones skip the lock
    if decided is not None:
        return decided
    with _LOCK:
        if key not in _OK:
            ext = _ext()
            equal = gain = None
            if ext is not None:
                with torch.inference_mode():
                    equal = _equal(ext, heads, kv_heads, d, scale)
                    gain = _gain(ext, heads, kv_heads, d, scale)
            _OK[key] = bool(equal) and gain >= 1.0
            log.info("one-token bf16 attention %dx%dx%d: %s (%s)", heads, kv_heads, d,
                     "the exact kernel" if _OK[key] else "HF's SDPA call",
                     "kernel not built" if ext is None else
                     f"bitwise HF's on every probe draw: {equal}; {gain or 0.0:.1f}x its speed at {TIME_LENGTH} slots")
        return _OK[key]


def run(q, k, v, scale) -> torch.Tensor:
    """q [1, H, 1, D], k, v [1, KV, L, D] (pool views) -> [1, H, 1, D], as HF's SDPA call (after ok)."""
    return _ext().exact_row(q, k, v, scale, None)


def decisions() -> dict[str, bool]:
    """What ok decided so far, per 'HxKVxD' (for logs and bench reports)."""
    with _LOCK:
        return {f"bfloat16 {k[0]}x{k[1]}x{k[2]}": v for k, v in _OK.items()}


def configure(enabled: bool = True) -> None:
    """Turn the kernel on or off and forget decisions (A/B runs, tests)."""
    global ENABLED
    with _LOCK:
        ENABLED = bool(enabled)
        _OK.clear()
