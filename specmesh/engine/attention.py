"""The engine's one attention call: HF's own SDPA call, or for a one-token query row the same
attention laid out as rows where that is much faster.

A one-token row of a grouped-query model (H query heads, KV kv heads, G = H / KV) attends with
torch's SDPA and enable_gqa, as HF generate does: q [1, H, 1, D] against k, v [1, KV, S, D]. The
same attention is G query *rows* of each kv head: q folded to [1, KV, G, D], no mask (a one-token
row sees every slot it is given), no enable_gqa. torch's CPU kernel takes a split-KV decode path
for one query row, and in bf16 without AMX that path is slow. Measured on a 2-core AMD EPYC with
avx512_bf16 and no AMX, torch 2.13 CPU, one thread, SmolLM2-135M's shape (9 heads, 3 kv heads,
D 64): HF's call 337 us at 256 slots and 3.3 ms at 2,200; the folded call 43 us and 552 us. That
is ~10 ms per sequence per step (30 layers) at a 256-token context beside a ~65 ms one-token
step. In float32 on the same CPU the two cost about the same.

The folded call sums in another order, so it need not be bitwise HF's: on that EPYC in bf16, ~10%
of calls differ in a few elements by one bf16 ulp, and the mesh's AR then equals plain HF bf16
generate on 5 of 12 held-out prompts over 64 tokens instead of 12 (`specmesh.bench.numerics
--vs-hf`, docs/numerics.md). Nothing inside the engine depends on HF's order: a one-token step and
every row of a deterministic verify take the same call, so speculation stays bitwise the target
alone either way. Hence `target_worker.attention_fold`: auto folds only where a start-up probe
finds the folded call bitwise equal to HF's and not slower (so the mesh's AR stays what HF
generate computes); true folds where the probe finds it at least FAST_GAIN x faster, bitwise or
not (the speed, at that identity cost; on other shapes the folded call can be slower: Qwen2.5's
12 x 2 x 128 ran at 0.1x HF's speed on that EPYC); false never. The decision and the measured
speed ratio are logged.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.nn.functional as F

from specmesh.engine import exactrow
from specmesh.engine.rowprobe import _wide, best_s

log = logging.getLogger(__name__)

PROBE_LENGTHS = (1, 2, 17, 64, 255, 513, 1100)  # slots an equality probe attends to
PROBE_DRAWS = 2
TIME_LENGTH = 1024  # slots of the timing probe
TIME_REPEATS = 5
FAST_GAIN = 1.5  # attention_fold true: fold where the folded call is at least this much faster

_FOLD: dict[tuple, bool] = {}
_SETTING: dict[str, bool | str] = {"fold": "auto"}
_LOCK = threading.Lock()


def _hf_call(q, k, v, mask, causal: bool, scale):
    """HF's SDPA call (transformers' sdpa_attention_forward): grouped-query heads by enable_gqa,
    keys read in place, never repeated. q: [1, H, n, D]; k, v: [1, KV, S, D]; mask: [n, S] bool
    or None -> [1, H, n, D]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def _folded(q, k, v, scale):
    """One query row per head, each kv head's G heads as G rows: q [1, H, 1, D] -> [1, H, 1, D]."""
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[3]
    rows = q.reshape(1, kv_heads, heads // kv_heads, d)  # [1, KV, G, D]
    return F.scaled_dot_product_attention(rows, k, v, scale=scale).reshape(1, heads, 1, d)


def _draw(gen, shape, spread: float, dtype, device) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * spread).to(dtype=dtype, device=device)


def _equal(device, dtype, heads: int, kv_heads: int, d: int, scale) -> bool:
    """Whether the folded call equals the HF call bit for bit on every probe draw. Queries and
    keys are N(0, 1) x a per-draw spread (scores of a few units: a softmax that weighs many slots;
    wide-range keys would saturate it to one slot and hide any other order); values wide-range
    (rowexact's _wide), so another order of the weighted sum rounds differently."""
    gen = torch.Generator().manual_seed(0)
    like = torch.empty(0, dtype=dtype, device=device)
    for length in PROBE_LENGTHS:
        for draw in range(PROBE_DRAWS):
            q = _draw(gen, (1, heads, 1, d), 0.5 + draw, dtype, device)
            k = _draw(gen, (1, kv_heads, length, d), 0.5 + draw, dtype, device)
            v = _wide((kv_heads * length, d), like, gen).reshape(1, kv_heads, length, d)
            if not torch.equal(_hf_call(q, k, v, None, False, scale), _folded(q, k, v, scale)):
                return False
    return True


def _gain(device, dtype, heads: int, kv_heads: int, d: int, scale) -> float:
    """HF's call time / the folded call's at TIME_LENGTH slots (fastest of a few each)."""
    gen = torch.Generator().manual_seed(1)
    q = _draw(gen, (1, heads, 1, d), 1.0, dtype, device)
    k, v = (_draw(gen, (1, kv_heads, TIME_LENGTH, d), 1.0, dtype, device) for _ in range(2))
    return (best_s(lambda: _hf_call(q, k, v, None, False, scale), device, TIME_REPEATS)
            / best_s(lambda: _folded(q, k, v, scale), device, TIME_REPEATS))


def configure(fold: bool | str) -> None:
    """target_worker.attention_fold: "auto" (probe), True or False (forced); forgets decisions."""
    with _LOCK:
        _SETTING["fold"] = fold
        _FOLD.clear()


def fold_ok(device, dtype, heads: int, kv_heads: int, d: int, scale) -> bool:
    """Whether one-token rows of this shape take the folded call (decided once, then cached)."""
    if heads == kv_heads or heads % kv_heads:
        return False
    key = (device.type if isinstance(device, torch.device) else torch.device(device).type, dtype, heads, kv_heads,
           d, scale)
    decided = _FOLD.get(key)  # every one-token row of every layer asks: decided ones skip the lock
    if decided is not None:
        return decided
    with _LOCK:
        if key not in _FOLD:
            setting = _SETTING["fold"]
            with torch.inference_mode():
                exact = _equal(device, dtype, heads, kv_heads, d, scale)
                gain = _gain(device, dtype, heads, kv_heads, d, scale)
            _FOLD[key] = bool(setting) and (exact and gain >= 1.0 if setting == "auto" else gain >= FAST_GAIN)
            log.info("one-token attention %s: %s (the folded call runs at %.1fx HF's speed at %d slots and is "
                     "%s; attention_fold %s)", key, "grouped heads as rows" if _FOLD[key] else "HF's SDPA call", gain,
                     TIME_LENGTH, "bitwise equal" if exact else "not bitwise equal", setting)
        return _FOLD[key]


def step_mask(new: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
    """new: [n, n] bool (which new rows each new row sees) past `length` cached slots -> the SDPA
    mask [n, L + n] of dtype: 0 where visible, -inf elsewhere: the very tensor torch's SDPA makes
    of a bool mask on every call (its convert_boolean_attn_mask, in the query's dtype), made once
    per step instead of once per layer."""
    visible = torch.cat([torch.ones(new.shape[0], length, dtype=torch.bool, device=new.device), new], 1)
    return torch.zeros(visible.shape, dtype=dtype, device=new.device).masked_fill_(~visible, float("-inf"))


def one_token_mode(device, dtype, heads: int, kv_heads: int, d: int, scale) -> int:
    """How a maskless one-token row of this shape attends: 1 the folded call (fold_ok), 2 HF's call's
    arithmetic from the exact kernel (exactrow.ok: bitwise HF's where probed), 0 HF's call. The
    same number selects the call in csrc (pool_attend, sdpa_rows)."""
    if heads != kv_heads and fold_ok(device, dtype, heads, kv_heads, d, scale):
        return 1
    return 2 if exactrow.ok(device, dtype, heads, kv_heads, d, scale) else 0


def sdpa(q, k, v, mask, causal: bool, scale):
    """q: [1, H, n, D]; k, v: [1, KV, S, D] (pool views, in place); mask: [n, S] bool or None ->
    [1, H, n, D]. A maskless one-token row takes one_token_mode's call; the rest HF's."""
    if q.shape[2] == 1 and mask is None and not causal:
        mode = one_token_mode(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[3], scale)
        if mode == 1:
            return _folded(q, k, v, scale)
        if mode == 2:
            return exactrow.run(q, k, v, scale)
    return _hf_call(q, k, v, mask, causal, scale)


def decisions() -> dict[str, bool]:
    """What fold_ok decided so far, per 'dtype HxKVxD on device' (for logs and bench reports)."""
    with _LOCK:
        return {f"{str(k[1]).replace('torch.', '')} {k[2]}x{k[3]}x{k[4]} on {k[0]}": v for k, v in _FOLD.items()}
