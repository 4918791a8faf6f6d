"""One forward over a batch of sequences, reading and writing their KV in place (pool.py).

The batch is packed, as vLLM packs it: the new tokens of every sequence, one after another, form
one row of T = sum(q_b) tokens, so the linears run once over T rows and nothing is padded.

    input_ids, position_ids: [1, T]      position of new token j of sequence b: L_b + depth_b[j]
    sequence b's rows:       [off_b, off_b + q_b)

Attention is the only part that sees sequences apart. It runs per sequence, inside the model's
layers, through an attention function registered with transformers (`specmesh_pool`), so any HF
causal LM built on the attention interface works unchanged. For layer l and sequence b it
1. writes the q_b new keys/values into the sequence's pool slots [L_b, L_b + q_b), in place;
2. attends the q_b queries to slots [0, L_b + q_b) read in place (a strided view, no copy):
   a chain with a causal mask over the new rows, a tree with its ancestor mask, a one-token step
   (or one row of a deterministic verify) with no mask at all, a prefill of an empty cache with
   is_causal. Each is HF's own SDPA call (grouped-query heads by enable_gqa, keys never
   repeated), so a one-token step or a prefill computes what HF generate computes, bit for bit.
   A one-token row may take a faster layout of that call (attention.py): by default only where
   a start-up probe finds it bitwise equal; with attention_fold true also where it is not.
   Where the model runs the packed CPU kernel (float32 on an x86 CPU), the step instead writes
   every new slot with one index_copy_ per layer and attends all its decode and verify rows in
   one call of the row-attention kernel (row_attn.py): each row alone over its own slots, so
   every row is bitwise the one-token step that sees them, at no per-row cost.

Nothing is committed: the caller keeps what it accepted with `SequenceKV.commit` (rejected drafts
are dropped by bookkeeping; a tree moves its accepted path's slots down, at most k of them).
The LM head runs in the model's dtype on the rows that need logits only (a prefill: its last);
logits come back as float32 on the host. With row_exact every position is computed with the
kernels of a one-token step (rowexact.py for the linears; here: attention row by row over exactly
the slots the row sees), so its logits are bitwise the target alone's.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specmesh.engine import bf16rows, cpu_gemm, lean, lean_hf, onednn, quant, row_attn, rowexact, rowgroup, rownorm
from specmesh.engine.attention import one_token_mode, sdpa, step_mask
from specmesh.engine.pool import SequenceKV, new_pool, new_sequence_kv  # noqa: F401 (re-exported)

ATTN_NAME = "specmesh_pool"
NATIVE = True  # a step's SDPA sequences in one C++ call per layer (native_geometry), where it applies
_NO_PATH = torch.empty(0, dtype=torch.long)


@dataclass
class _Seq:
    """One sequence of a step. mask: [n, L + n] additive (0 visible, -inf not) in the pool's dtype on
    the device (None: all visible);
    paths: row_exact tree rows, each row's ancestor path as new-token indices, root first, all
    rows' paths in one [E] long tensor on the device and row j's at [off[j], off[j + 1]) (off:
    [n + 1] long on the host); None for chains."""

    kv: SequenceKV
    offset: int
    n: int
    causal: bool = False
    mask: torch.Tensor | None = None
    paths: tuple[torch.Tensor, torch.Tensor] | None = None
    kernel: bool = False  # its rows attend in the row-attention kernel (row_attn)


@dataclass
class _Plan:
    seqs: list[_Seq]
    row_exact: bool
    rows: list[row_attn.RowPlan] | None = None  # the kernel's rows per pool, when the step takes it
    native: tuple | None = None  # (pool, geo, masks, paths, offs) for csrc's pool_attend (native_geometry)


_PLAN: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar("specmesh_pool_plan", default=None)


@dataclass
class StepOutput:
    """Per-sequence result of one batched step."""

    logits: torch.Tensor  # [r, V] float32 on the host: the rows asked for (default: every new row)
    hidden_states: tuple[torch.Tensor, ...] | None = None  # per HF hidden-state index [Q_b, H], when asked


def _row_width(q, kv_heads: int, scale, one: int) -> int:
    """csrc sdpa_rows' chain row groups for deterministic rows of q's shape: rowgroup's probed width,
    none on the exact kernel (a row there costs less than a grouped call's fixed work)."""
    return 0 if one == 2 else rowgroup.width(q.device, q.dtype, q.shape[1], kv_heads, q.shape[3], scale, one == 1)


def _rows_exact(q, k, v, length: int, paths, scale, out) -> None:
    """Deterministic rows: each query row alone, unmasked, over exactly the slots it sees laid out
    as a one-token step sees them: the cache, then its own path. q: [1, heads, n, D]; k, v: the
    sequence's pool views [1, kv_heads, L + n, D]; paths: _Seq.paths; out: [n, heads, D]. A chain
    row j sees slots [0, L + j + 1) in place. A tree row sees the cache and its ancestors: its
    path's few slots are copied right after the cache for its call, and the tree's slots are put
    back afterwards. On the CPU the extension computes the same rows without the Python around
    each call, consecutive chain rows in one call where rowgroup probed that bitwise
    (csrc/sdpa_rows.cpp: bitwise this loop)."""
    ext = cpu_gemm.load() if q.device.type == "cpu" else None
    flat, off = paths if paths is not None else (_NO_PATH, _NO_PATH)
    if ext is not None:
        heads, kv_heads = q.shape[1], k.shape[1]
        one = one_token_mode(q.device, q.dtype, heads, kv_heads, q.shape[3], scale)
        ext.sdpa_rows(q, k, v, length, flat, off, scale, one, _row_width(q, kv_heads, scale, one), out)
        return
    n = q.shape[2]
    if paths is None:
        for j in range(n):
            out[j] = sdpa(q[:, :, j : j + 1], k[:, :, : length + j + 1], v[:, :, : length + j + 1], None, False,
                           scale)[0, :, 0]
        return
    tree_k, tree_v = k[:, :, length:].clone(), v[:, :, length:].clone()  # [1, kv_heads, n, D]
    bounds = off.tolist()
    for j in range(n):
        path = flat[bounds[j] : bounds[j + 1]]
        d = len(path)
        k[:, :, length : length + d] = tree_k.index_select(2, path)
        v[:, :, length : length + d] = tree_v.index_select(2, path)
        out[j] = sdpa(q[:, :, j : j + 1], k[:, :, : length + d], v[:, :, : length + d], None, False, scale)[0, :, 0]
    k[:, :, length:] = tree_k
    v[:, :, length:] = tree_v


def pool_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: [1, heads, T, D]; key/value: [1, kv_heads, T, D] (the packed new rows, RoPE applied)
    -> ([1, T, heads, D], None). Outside batched_step: HF's own SDPA path, unchanged."""
    plan = _PLAN.get()
    if plan is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    return _attend(module.layer_idx, query, key, value, scaling), None


def _attend(layer: int, query, key, value, scaling) -> torch.Tensor:
    """The step's attention for one layer (pool_attention's; lean_hf.forward's `attend`):
    query [1, heads, T, D], key/value [1, kv_heads, T, D] -> [1, T, heads, D]."""
    plan = _PLAN.get()
    heads, d = query.shape[1], query.shape[3]
    if plan.native is not None:  # every sequence on torch's SDPA, in one C++ call (the loop below)
        pool, geo, masks, paths, offs = plan.native
        one = one_token_mode(query.device, query.dtype, heads, key.shape[1], d, scaling)
        width = _row_width(query, key.shape[1], scaling, one) if plan.row_exact else 0
        return cpu_gemm.load().pool_attend(query, key, value, pool.k[layer], pool.v[layer], geo, masks, paths, offs,
                                           scaling, one, width)
    out = None  # [T, heads, D]
    if plan.rows is not None:  # every new slot written at once; the kernel's rows in one call per pool
        out = row_attn.step(plan.rows, layer, key, value, query, scaling if scaling is not None else d**-0.5)
    if out is None:  # the kernel took no row
        out = query.new_empty((query.shape[2], heads, d))
    for s in plan.seqs:
        a, n, length = s.offset, s.n, s.kv.length
        if s.kernel:
            continue
        if plan.rows is None:
            s.kv.write(layer, key[0, :, a : a + n], value[0, :, a : a + n])
        k, v = s.kv.keys(layer, length + n)[None], s.kv.values(layer, length + n)[None]  # [1, kv_heads, L + n, D]
        if plan.row_exact and n > 1:
            _rows_exact(query[:, :, a : a + n], k, v, length, s.paths, scaling, out[a : a + n])
            continue
        o = sdpa(query[:, :, a : a + n], k, v, s.mask, s.causal, scaling)  # [1, heads, n, D]
        out[a : a + n] = o[0].transpose(0, 1)
    return out.unsqueeze(0)


def pool_mask(*args, **kwargs):
    """transformers' mask for this attention: none inside a step (pool_attention knows each
    sequence's visible slots), HF's SDPA mask otherwise (generate on the same model, any thread)."""
    from transformers.masking_utils import sdpa_mask

    return None if _PLAN.get() is not None else sdpa_mask(*args, **kwargs)


def attach(model: torch.nn.Module) -> torch.nn.Module:
    """Route the model's attention through pool_attention; outside a step (HF generate on the same
    model object) it is HF's SDPA path with HF's masks, unchanged. Idempotent."""
    if getattr(model, "_specmesh_pool_attn", False):
        return model
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(ATTN_NAME, pool_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, pool_mask)
    model.set_attn_implementation(ATTN_NAME)
    rowexact.route(model)  # linears: the packed CPU kernel / deterministic chunks inside a step
    model._specmesh_pool_attn = True
    return model


def _plan(kvs, inputs, new_masks, depths, row_exact: bool, kernel: bool,
          bf16_max: int = row_attn.BF16_MAX_ROWS) -> tuple[_Plan, list[int]]:
    """The step's per-sequence attention plan and the packed position ids (host list). kernel: the
    row-attention kernel may take the step (row_attn.usable); bf16_max: row_attn.bf16_max_rows."""
    seqs, positions, offset = [], [], 0
    trees = [new_masks[b] if new_masks and new_masks[b] is not None else None for b in range(len(kvs))]
    rows, taken = (row_attn.plan(kvs, [len(t) for t in inputs], trees, bool(row_exact), bf16_max) if kernel
                   else (None, [False] * len(kvs)))
    for b, (kv, toks) in enumerate(zip(kvs, inputs)):
        n, length, tree = len(toks), kv.length, trees[b]
        depth = depths[b] if depths and depths[b] is not None else None
        positions += [length + int(x) for x in depth] if depth is not None else range(length, length + n)
        s = _Seq(kv, offset, n, kernel=taken[b])
        if s.kernel:  # its slots are in `rows`
            pass
        elif row_exact and n > 1:
            if tree is not None:  # topological order: a row's ancestors in index order are root first
                ancestors = tree.nonzero()  # [E, 2] (row, ancestor), row-major: each row's path in order
                off = torch.zeros(n + 1, dtype=torch.long)
                off[1:] = tree.sum(1).cumsum(0)
                s.paths = (ancestors[:, 1].contiguous().to(kv.device), off)
        elif length == 0 and tree is None and n > 1:
            s.causal = True
        elif n > 1:
            new = tree.to(kv.device) if tree is not None else torch.ones(n, n, dtype=torch.bool, device=kv.device).tril()
            s.mask = step_mask(new, length, kv.pool.dtype)
        seqs.append(s)
        offset += n
    return _Plan(seqs, row_exact, rows, native_geometry(seqs, row_exact) if rows is None else None), positions


def native_geometry(seqs: list[_Seq], row_exact: bool) -> tuple | None:
    """pool_attend's arguments for a step whose sequences share one CPU pool and all attend with
    torch's SDPA (csrc/lean_layer.cpp), or None (another device, several pools, no extension)."""
    pool = seqs[0].kv.pool
    if not NATIVE or any(s.kv.pool is not pool for s in seqs) or seqs[0].kv.device.type != "cpu" or cpu_gemm.load() is None:
        return None
    geo, masks, paths, offs = [], [], [], []
    for s in seqs:
        rows = bool(row_exact) and s.n > 1
        geo += [s.offset, s.n, s.kv.start, s.kv.length, 2 if rows else 1 if s.causal else 0]
        masks.append(s.mask)
        paths.append(s.paths[0] if s.paths is not None else _NO_PATH)
        offs.append(s.paths[1] if s.paths is not None else _NO_PATH)
    return pool, geo, masks, paths, offs


def lm_head(model: torch.nn.Module, hidden: torch.Tensor, row_exact: bool | int) -> torch.Tensor:
    """hidden: [r, H] -> logits [r, V] float32, the head in the model's dtype (a draft's int8 copy
    where quantized, the packed CPU kernel where installed). Row-exact: in chunks of the head's
    probed invariant row count (one-row calls where it is 0), each padded to its row floor."""
    head = model.get_output_embeddings()
    out = None if row_exact else quant.apply(head, hidden)  # a draft model's int8 head
    if out is None:
        out = cpu_gemm.packed(head, hidden, exact=row_exact)
    if out is not None:
        return out.float()
    w = head.weight  # [V, H]
    if not row_exact:
        out = onednn.packed(head, hidden)  # oneDNN's prepacked head where installed (onednn.py)
        return (F.linear(hidden, w) if out is None else out).float()
    out = bf16rows.call(head, hidden, onednn.in_prefill(), det=True)  # a lone row's exact kernel copy
    if out is not None:
        return out.float()
    step, floor = rowexact.head_chunking(model, int(row_exact))
    lin = rowexact.floored(onednn.apply_of(head) or F.linear, floor)
    if hidden.shape[0] <= step:
        return lin(hidden, w).float()
    return torch.cat([lin(hidden[i : i + step], w) for i in range(0, hidden.shape[0], step)]).float()


def _lean_ok(model, plan: _Plan, rows: int, row_exact: bool) -> bool:
    """Whether the step takes lean.forward (bitwise HF's modules, fewer calls): every row on the
    row-attention kernel, and the linears on the packed kernel as HF's path would run them (all
    rows where deterministic, else up to cpu_gemm.MAX_ROWS; its norms take every row at once, so
    a deterministic step only where they were probed invariant to that many or to the probe's
    limit: a CPU's per-row reduction, which lean runs only on)."""
    if plan.rows is None or not all(s.kernel for s in plan.seqs):
        return False
    fits = rownorm.norm_rows(model) >= min(rows, rowexact.PROBE_ROWS) if row_exact else rows <= cpu_gemm.MAX_ROWS
    return fits and lean.prepare(model)


@torch.inference_mode()
def batched_step(
    model: torch.nn.Module,
    kvs: list[SequenceKV],
    inputs: list[list[int]],
    new_masks: list[torch.Tensor | None] | None = None,
    depths: list[torch.Tensor | None] | None = None,
    hidden_layers: tuple[int, ...] = (),
    row_exact: bool | int = False,
    logits_rows: list[list[int] | None] | None = None,
) -> list[StepOutput]:
    """One forward over B sequences. inputs[b]: the Q_b new token ids of sequence b (Q_b >= 1).

    new_masks[b]: [Q_b, Q_b] bool, which new tokens query i may see (default causal).
    depths[b]: [Q_b] long, position offset of each new token past the cache (default arange).
    hidden_layers: HF hidden_states indices to return (0 = embeddings, i = after layer i).
    row_exact: compute every position with the kernels of a one-token step (rowexact.install
    must have been applied), so its logits equal the target alone's bitwise; 2 (rowexact.rows):
    with the 2-row floor where the probe installed it, the one-token step included.
    logits_rows[b]: which new rows of sequence b need logits (None: all).
    The new slots are written in place past each cache's length; the caller commits what it keeps.
    """
    if any(len(x) == 0 for x in inputs):
        raise ValueError("every sequence needs at least one new token")
    if row_exact and not rowexact.is_installed(model):
        raise RuntimeError("row_exact asked for, but rowexact.install(model) was not applied")
    attach(model)
    for kv, toks in zip(kvs, inputs):
        kv.ensure(kv.length + len(toks))
    device = kvs[0].device
    plan, positions = _plan(kvs, inputs, new_masks, depths, row_exact,
                            row_attn.usable(model, kvs, int(row_exact), [len(t) for t in inputs]),
                            row_attn.bf16_max_rows(model))
    ids = torch.tensor([t for toks in inputs for t in toks], dtype=torch.long).to(device)[None]  # [1, T]
    pos = torch.tensor(positions, dtype=torch.long).to(device)[None]  # [1, T]
    token = _PLAN.set(plan)
    try:
        with rowexact.rows(row_exact), cpu_gemm.active(), onednn.step(any(kv.length == 0 for kv in kvs)):
            if _lean_ok(model, plan, ids.shape[1], row_exact):
                states = dict.fromkeys(hidden_layers)  # index -> [T, H], filled by the forward
                final = lean.forward(model, ids[0], pos[0], plan.rows, states)  # [T, H]
            elif lean_hf.prepare(model):  # HF's modules' arithmetic without the modules
                states = dict.fromkeys(hidden_layers)
                final = lean_hf.forward(model, ids[0], pos[0], _attend, states)  # [T, H]
            else:
                out = model.model(input_ids=ids, position_ids=pos, use_cache=False,
                                  output_hidden_states=bool(hidden_layers))
                final = out.last_hidden_state[0]  # [T, H]
                states = {i: out.hidden_states[i][0] for i in hidden_layers}
            wanted = [list(range(len(toks))) if not logits_rows or logits_rows[b] is None else list(logits_rows[b])
                      for b, toks in enumerate(inputs)]
            rows = torch.tensor([s.offset + j for s, w in zip(plan.seqs, wanted) for j in w], dtype=torch.long)
            logits = lm_head(model, final.index_select(0, rows.to(device)), row_exact).cpu()  # [R, V] float32
    finally:
        _PLAN.reset(token)
    results, at = [], 0
    for s, w in zip(plan.seqs, wanted):
        hidden = tuple(states[i][s.offset : s.offset + s.n].cpu() for i in hidden_layers) if hidden_layers else None
        results.append(StepOutput(logits[at : at + len(w)], hidden))
        at += len(w)
    return results
