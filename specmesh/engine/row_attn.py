"""The step's attention as one kernel call per layer: each query row alone over the pool slots it
sees (csrc/row_attention.cpp), for float32 CPU models that run the packed CPU kernel.

A step's rows, packed as the model sees them ([T] over its B sequences), each get a slot list:

    chain row j of a sequence at pool range start, with L cached slots: [start, start + L + j + 1)
    tree row j: [start, start + L), then its path's new slots start + L + p (root first)

and the kernel computes every (row, kv head) alone, in an order fixed by its slot count only. So a
verified row is bitwise the one-token step that later sees the same slots, with no per-row calls,
no path copies for trees and no per-sequence Python per layer: one index_copy_ writes the step's
new keys and values where they belong, one call attends. Measured on a 2-core AMD EPYC (AVX2, no
AVX-512), one thread, SmolLM2's 9 x 3 x 64 heads: one row at 256 slots 23 us (torch SDPA 47 us), at
2,200 slots 192 us (327 us). Where AVX-512 is built, a sequence's rows (consecutive, same first
slot) run together in the same arithmetic (csrc/row_attention_group.cpp): keys and values loaded
once for all of them; a Zen 5, bf16, 5 rows at 256 / 2,200 slots: 51 / 405 -> 24 / 170 us.

Sequences whose rows do not fit (a long prompt's prefill: more than MAX_ROWS causal rows, and
every row attends to all before it, outside the deterministic mode) keep torch SDPA; so do GPUs
(kv.py's path). bf16 CPU models take it where enable_bf16 allowed it: the kernel widens bf16 to
float32 as it loads and rounds its output once, which is not HF's bf16 SDPA bit for bit, and it
replaces one SDPA call per sequence (per row, deterministic) and layer (on a Zen 4 EPYC, one bf16
row at 256 slots: ~255 us in SDPA, ~33 us here). In the 2-row-floor mode (rowexact.rows(2)) it
is the mesh's own decode step, every step. In batched steps (not deterministic) it takes what is
not the target alone's arithmetic anyway: never a lone one-token step and never a prefill (a
sequence with nothing cached), so the target alone at concurrency 1 stays HF's SDPA, and its
output HF `generate`'s; nor a sequence of more rows than bf16_max_rows (BF16_MAX_ROWS, or more
where the probe below finds the kernel faster at WIDER_ROWS too), where one SDPA call over them is
cheaper; and under target_worker.cpu_kernel auto only where a start-up timing probe finds
it faster than those SDPA calls (bf16_gain: on an AMX Xeon SDPA's AMX GEMMs serve a sequence's rows
at once, and the kernel ran at 0.74-0.79x their speed until it ran a sequence's rows together,
session 44; session 45's probe there read 1.99x). The deterministic mode on HF's kernels
(rows(1)) never takes it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from specmesh.engine import cpu_gemm

log = logging.getLogger(__name__)

MAX_ROWS = 64  # a sequence with more new rows than this (a prefill) keeps SDPA, unless it is a tree
# bf16, batched: a sequence with more new rows keeps SDPA, whose one call over its rows costs less
# from about 9 rows (a Zen 5 EPYC, 256 slots, 16 sequences: 5 rows 119 vs 137 ms, 9 rows 204 vs 195,
# a 16-node tree 378 vs 313; docs/bench/engine.md#12); under cpu_kernel auto the start-up probe
# raises it where the kernel also wins at WIDER_ROWS (a Zen 4 EPYC, 256 slots, SmolLM2's 30 layers,
# chains of 9 rows: 5.4 / 20.4 / 86.7 ms against SDPA's 9.3 / 29.4 / 120.2 at 1 / 4 / 16 sequences)
BF16_MAX_ROWS = 8
WIDER_ROWS = ((9, 16), (17, MAX_ROWS))  # (probed rows, the limit where the kernel wins there too)


@dataclass
class RowPlan:
    """One pool's share of a step: its sequences' packed new rows (written in place), the rows the
    kernel attends (a subset: a long prefill keeps SDPA) and the slots each of those sees."""

    pool: object  # the KVPool these sequences live in
    new_rows: torch.Tensor | None  # [Tp] long: packed rows whose keys go to this pool (None: all T)
    write_slots: torch.Tensor  # [Tp] long: each one's pool slot
    index: torch.Tensor | None  # [R] long: the packed rows the kernel takes (None: all T)
    start: torch.Tensor  # [R] long
    length: torch.Tensor  # [R] long: contiguous slots from start
    off: torch.Tensor  # [R + 1] long: extra slots of row r are extra[off[r]:off[r + 1]]
    extra: torch.Tensor  # [E] long: pool slots (a tree row's path)


def enable_bf16(model: torch.nn.Module, on: bool | str = True) -> bool:
    """Let bf16 CPU steps take the kernel (module docstring: the 2-row-floor mode, and batched
    steps other than a lone one-token step or a prefill), or not (on=False); "auto" (batched
    steps, target_worker.cpu_kernel's default): only where the start-up timing probe finds the
    kernel faster than the SDPA calls it replaces (bf16_gain; logged). The kernel is built here,
    not inside a step. True when it is allowed and available."""
    param = next(model.parameters())
    ok = bool(on) and param.dtype == torch.bfloat16 and param.device.type == "cpu" and cpu_gemm.load() is not None
    limit = BF16_MAX_ROWS
    if ok and on == "auto":
        gain = bf16_gain(model)
        ok = gain >= 1.0
        model._specmesh_row_attn_gain = round(gain, 2)
        for rows, wider in WIDER_ROWS if ok else ():  # longer chains and trees too, while it still wins
            if bf16_gain(model, rows) < 1.0:
                break
            limit = wider
        log.info("bf16 batched verify rows' attention: %s (the row kernel runs at %.2fx the SDPA calls' speed; "
                 "cpu_kernel auto; up to %d rows a sequence)", "the row kernel" if ok else
                 "torch SDPA, one call per sequence", gain, limit)
    model._specmesh_row_attn_bf16 = ok
    model._specmesh_row_attn_max = limit
    return ok


def bf16_max_rows(model: torch.nn.Module) -> int:
    """The most new rows of a sequence the kernel takes in a bf16 batched step (enable_bf16)."""
    return getattr(model, "_specmesh_row_attn_max", BF16_MAX_ROWS)


PROBE_SLOTS = 256  # cached slots per sequence of bf16_gain's probe (the micro-bench's context)
PROBE_SEQS, PROBE_ROWS = 4, 5  # ... its sequences, and new rows each (a 4-draft verify)


def bf16_gain(model: torch.nn.Module, rows: int = PROBE_ROWS) -> float:
    """Time of one layer's attention for PROBE_SEQS sequences of `rows` chain rows over
    PROBE_SLOTS cached slots each, in a one-layer bf16 pool of the model's heads, as a batched step
    runs it without the kernel (kv.py: one SDPA call per sequence over its pool view, its step
    mask) / with it (plan and attend, one call); fastest of a few each. > 1: the kernel is faster.
    On a Zen 4 EPYC HF's bf16 SDPA is slow and the kernel wins; on an AMX Xeon SDPA's AMX GEMMs
    serve several rows at once and it loses."""
    from specmesh.engine.attention import sdpa, step_mask
    from specmesh.engine.pool import KVPool, model_kv_shape
    from specmesh.engine.rowprobe import best_s

    _, kv_heads, d = model_kv_shape(model)
    heads, n, length, seqs = model.config.get_text_config().num_attention_heads, rows, PROBE_SLOTS, PROBE_SEQS
    gen = torch.Generator().manual_seed(0)
    pool = KVPool(1, kv_heads, d, seqs * (length + n), torch.bfloat16)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    kvs = [pool.allocate(length + n) for _ in range(seqs)]
    for kv in kvs:
        kv.commit(length)
    plans, _ = plan(kvs, [n] * seqs, [None] * seqs)
    query = torch.randn(1, heads, seqs * n, d, generator=gen).bfloat16()  # the step's packed rows [1, H, T, D]
    mask, scale = step_mask(torch.ones(n, n, dtype=torch.bool).tril(), length, torch.bfloat16), d**-0.5

    def by_sdpa():
        for b, kv in enumerate(kvs):
            sdpa(query[:, :, b * n : (b + 1) * n], kv.keys(0, length + n)[None], kv.values(0, length + n)[None], mask,
                 False, scale)

    with torch.inference_mode():
        return best_s(by_sdpa) / best_s(lambda: attend(plans[0], 0, query, scale))


def usable(model: torch.nn.Module, kvs, row_exact: int = 0, sizes: list[int] | None = None) -> bool:
    """Whether this step can take the kernel: the model runs the packed CPU kernel (float32, CPU),
    or it is a bf16 CPU model allowed it (enable_bf16) in the 2-row-floor mode or a batched step
    that is not one sequence's one-token step (sizes: new rows per sequence); and its heads fit
    (head dim a multiple of 32, query heads a multiple of kv heads)."""
    if getattr(model, "_specmesh_cpu_gemm", False):  # True only where the extension loaded
        dtype = torch.float32
    elif getattr(model, "_specmesh_row_attn_bf16", False) and (
            row_exact >= 2 or (row_exact == 0 and sizes is not None and sum(sizes) > 1)):
        dtype = torch.bfloat16
    else:
        return False
    heads = model.config.num_attention_heads
    return all(kv.pool.dtype == dtype and kv.pool.device.type == "cpu" and kv.pool.head_dim % 32 == 0
               and heads % kv.pool.kv_heads == 0 for kv in kvs)


def takes(n: int, tree, exact: bool = False, cached: int = 1, bf16: bool = False,
          bf16_max: int = BF16_MAX_ROWS) -> bool:
    """Whether a sequence's n new rows (past `cached` slots) go to the kernel: any row-exact step's
    rows (the one-token step's kernel for all of them); in a bf16 batched step, up to bf16_max
    rows (bf16_max_rows) of a sequence with a cache (a prefill keeps SDPA: HF's prompt KV, module
    docstring); else a tree, or a chain of up to MAX_ROWS."""
    if exact:
        return True
    if bf16:
        return cached > 0 and n <= bf16_max
    return tree is not None or n <= MAX_ROWS


def _long(xs) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


def plan(kvs, sizes: list[int], trees: list, exact: bool = False,
         bf16_max: int = BF16_MAX_ROWS) -> tuple[list[RowPlan], list[bool]]:
    """The row plans of a step, one per pool (the target's shared pool: one): kvs[b] holds sizes[b]
    new rows, trees[b] its [n, n] bool ancestor mask or None (a chain); exact: a row-exact step;
    bf16_max: takes'. Also, per sequence, whether the kernel takes it."""
    groups: dict[int, dict[str, list]] = {}
    taken, at = [], 0
    for kv, n, tree in zip(kvs, sizes, trees):
        g = groups.setdefault(id(kv.pool), {"pool": kv.pool, "new": [], "write": [], "index": [], "start": [],
                                            "length": [], "off": [0], "extra": []})
        base, cached = kv.start, kv.length
        g["new"] += range(at, at + n)
        g["write"] += range(base + cached, base + cached + n)
        taken.append(takes(n, tree, exact, cached, kv.pool.dtype == torch.bfloat16, bf16_max))
        if taken[-1]:
            g["index"] += range(at, at + n)
            g["start"] += [base] * n
            if tree is None:
                g["length"] += range(cached + 1, cached + n + 1)
                g["off"] += [g["off"][-1]] * n
            else:
                g["length"] += [cached] * n
                for j in range(n):
                    g["extra"] += [base + cached + int(p) for p in tree[j].nonzero().flatten()]
                    g["off"].append(len(g["extra"]))
        at += n
    return [RowPlan(g["pool"], None if len(g["new"]) == at else _long(g["new"]), _long(g["write"]),
                    None if len(g["index"]) == at else _long(g["index"]), _long(g["start"]), _long(g["length"]),
                    _long(g["off"]), _long(g["extra"])) for g in groups.values()], taken


def write(p: RowPlan, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """key, value: [1, kv_heads, T, D] -> this pool's new rows' slots of this layer, in place."""
    k, v = key[0], value[0]  # [kv_heads, T, D]
    if p.new_rows is not None:
        k, v = k.index_select(1, p.new_rows), v.index_select(1, p.new_rows)
    p.pool.k[layer].index_copy_(1, p.write_slots, k)
    p.pool.v[layer].index_copy_(1, p.write_slots, v)


def step(plans: list[RowPlan], layer: int, key: torch.Tensor, value: torch.Tensor, query: torch.Tensor,
         scale: float) -> torch.Tensor | None:
    """One layer of a step on the kernel: every plan's new keys and values written, its rows
    attended. key, value: [1, kv_heads, T, D]; query: [1, heads, T, D]. Returns [T, heads, D]: a
    plan's output itself where it covers every row, else a new tensor with the kernel's rows filled
    in (the others are the caller's to fill); None when the kernel took no row."""
    out = None
    for p in plans:
        write(p, layer, key, value)
        rows = attend(p, layer, query, scale)  # [R, heads, D]
        if rows is None:
            continue
        if p.index is None:
            return rows
        if out is None:
            out = query.new_empty((query.shape[2], query.shape[1], query.shape[3]))
        out.index_copy_(0, p.index, rows)
    return out


def attend(p: RowPlan, layer: int, query: torch.Tensor, scale: float) -> torch.Tensor | None:
    """query: [1, heads, T, D] -> [R, heads, D], the kernel's rows (p.index, or all T); None when
    the kernel takes none of this pool's rows."""
    if p.index is not None and p.index.numel() == 0:
        return None
    q = query[0].transpose(0, 1)  # [T, heads, D]
    if p.index is not None:
        q = q.index_select(0, p.index)
    return cpu_gemm.load().row_attention(q, p.pool.k[layer], p.pool.v[layer], p.start, p.length, p.off, p.extra,
                                         float(scale))
