"""Per-sequence KV caches and one batched forward over sequences of different lengths.

Every sequence owns its KV (one SequenceKV). A batched step right-pads the caches of the
sequences in the batch into one DynamicCache, appends each sequence's new tokens after the
padding, and masks with an explicit 4-D boolean mask:

    slot layout per row b:  [ own KV 0..L_b-1 | padding L_b..Lmax-1 | new tokens Lmax..Lmax+Q-1 ]
    query j of row b may see: own KV slots, and new slot Lmax+i iff new_mask[b][j, i]
    position of query j of row b: L_b + depth_b[j]

The default new_mask is causal (i <= j) and depth = j: plain chain verification. A tree verify
passes its ancestor mask and node depths instead. The same code serves prefill (L_b = 0, new =
prompt), verification (new = [last token, drafts...]) and AR drafting (new = one token).
The LM head runs in float32 on the final hidden states, for every path alike.

Device: the caches live on the model's device (cpu or a GPU). Inputs and masks are built on the
host and moved once per step; the per-sequence logits and hidden states come back on the host
(sampling and the wire format are host-side), the new KV slots stay on the device.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specmesh.engine import rowexact


class SequenceKV:
    """One sequence's keys/values for every layer, in growable buffers.

    keys[l], values[l]: [kv_heads, capacity, head_dim]; slots [0, length) are valid.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, capacity: int = 256,
                 device: torch.device | str = "cpu"):
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.device = torch.device(device)
        self.length = 0
        shape = (kv_heads, capacity, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def nbytes(self) -> int:
        """Bytes of the valid part (what the cache holds for this sequence)."""
        per_slot = 2 * self.num_layers * self.kv_heads * self.head_dim * self.keys[0].element_size()
        return per_slot * self.length

    def _grow(self, needed: int) -> None:
        cap = self.capacity
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        for store in (self.keys, self.values):
            for i, buf in enumerate(store):
                grown = torch.empty((self.kv_heads, new_cap, self.head_dim), dtype=self.dtype, device=self.device)
                grown[:, : self.length] = buf[:, : self.length]
                store[i] = grown

    def append(self, new_keys: list[torch.Tensor], new_values: list[torch.Tensor], keep: torch.Tensor | None = None) -> None:
        """Append new slots. new_keys[l]: [kv_heads, Q, head_dim]; keep: [n] slot indices into Q
        (e.g. the accepted path of a tree), default all Q in order."""
        if keep is not None:
            keep = keep.to(self.device)
            new_keys = [k.index_select(1, keep) for k in new_keys]
            new_values = [v.index_select(1, keep) for v in new_values]
        n = new_keys[0].shape[1]
        self._grow(self.length + n)
        for layer in range(self.num_layers):
            self.keys[layer][:, self.length : self.length + n] = new_keys[layer]
            self.values[layer][:, self.length : self.length + n] = new_values[layer]
        self.length += n

    def truncate(self, length: int) -> None:
        """Drop slots >= length (drafts that were rejected)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {length}")
        self.length = length


@dataclass
class StepOutput:
    """Per-sequence result of one batched step."""

    logits: torch.Tensor  # [Q_b, V] float32: logits at each new token
    new_keys: list[torch.Tensor]  # per layer [kv_heads, Q_b, head_dim]: KV of the new tokens
    new_values: list[torch.Tensor]
    hidden_states: tuple[torch.Tensor, ...] | None = None  # per HF hidden-state index [Q_b, H], when asked


def lm_head_fp32(model: torch.nn.Module) -> torch.Tensor:
    """The LM head weight [V, H] as float32, converted once per model and kept on it."""
    head = getattr(model, "_specmesh_head_fp32", None)
    if head is None:
        head = model.get_output_embeddings().weight.detach().float().contiguous()
        model._specmesh_head_fp32 = head
    return head


def new_sequence_kv(model: torch.nn.Module, capacity: int = 256) -> SequenceKV:
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    param = next(model.parameters())
    return SequenceKV(cfg.num_hidden_layers, kv_heads, head_dim, param.dtype, capacity, param.device)


def _padded_cache(kvs: list[SequenceKV]) -> tuple[DynamicCache, int]:
    """Right-pad every sequence's KV to the longest; returns the cache and Lmax."""
    lmax = max(kv.length for kv in kvs)
    ref = kvs[0]
    layers = []
    for layer in range(ref.num_layers):
        k = torch.zeros((len(kvs), ref.kv_heads, lmax, ref.head_dim), dtype=ref.dtype, device=ref.device)
        v = torch.zeros_like(k)
        for b, kv in enumerate(kvs):
            k[b, :, : kv.length] = kv.keys[layer][:, : kv.length]
            v[b, :, : kv.length] = kv.values[layer][:, : kv.length]
        layers.append((k, v))
    return DynamicCache(layers), lmax


def _batch_inputs(kvs, inputs, new_masks, depths):
    """Build input_ids [B, Q], position_ids [B, Q] and the boolean mask [B, 1, Q, Lmax + Q]."""
    q = max(len(x) for x in inputs)
    lmax = max(kv.length for kv in kvs)
    bsz = len(kvs)
    ids = torch.zeros((bsz, q), dtype=torch.long)
    pos = torch.zeros((bsz, q), dtype=torch.long)
    mask = torch.zeros((bsz, 1, q, lmax + q), dtype=torch.bool)
    causal = torch.tril(torch.ones((q, q), dtype=torch.bool))
    for b, (kv, toks) in enumerate(zip(kvs, inputs)):
        n = len(toks)
        ids[b, :n] = torch.tensor(toks, dtype=torch.long)
        depth = depths[b] if depths and depths[b] is not None else torch.arange(n)
        pos[b, :n] = kv.length + depth
        mask[b, 0, :, : kv.length] = True
        if new_masks and new_masks[b] is not None:
            mask[b, 0, :n, lmax : lmax + n] = new_masks[b]  # [n, n] ancestor mask (tree verify)
        else:
            mask[b, 0, :n, lmax : lmax + n] = causal[:n, :n]
        # padded query rows attend only to themselves so softmax stays finite; outputs dropped
        mask[b, 0, n:, lmax + n :] = torch.eye(q - n, dtype=torch.bool)
    return ids, pos, mask


@torch.inference_mode()
def batched_step(
    model: torch.nn.Module,
    kvs: list[SequenceKV],
    inputs: list[list[int]],
    new_masks: list[torch.Tensor | None] | None = None,
    depths: list[torch.Tensor | None] | None = None,
    hidden_layers: tuple[int, ...] = (),
    row_exact: bool = False,
) -> list[StepOutput]:
    """One forward over B sequences. inputs[b]: the Q_b new token ids of sequence b (Q_b >= 1).

    new_masks[b]: [Q_b, Q_b] bool, which new tokens query i may see (default causal).
    depths[b]: [Q_b] long, position offset of each new token past the cache (default arange).
    hidden_layers: HF hidden_states indices to return (0 = embeddings, i = after layer i).
    row_exact: compute every position with the kernels of a one-token step (rowexact.py; the
    model must have rowexact.install applied), so its logits equal the target alone's bitwise.
    The KV caches are not modified; the caller appends what it keeps.
    """
    if any(len(x) == 0 for x in inputs):
        raise ValueError("every sequence needs at least one new token")
    cache, lmax = _padded_cache(kvs)
    ids, pos, mask = _batch_inputs(kvs, inputs, new_masks, depths)  # built on the host
    plan = None
    if row_exact and (len(inputs) > 1 or len(inputs[0]) > 1):  # one row is the one-token step already
        if not rowexact.is_installed(model):
            raise RuntimeError("row_exact asked for, but rowexact.install(model) was not applied")
        # before an all-visible mask is dropped; slot indices on the caches' device
        plan = rowexact.plan_from_mask(mask, [len(x) for x in inputs], kvs[0].device)
    if bool(mask.all()):
        mask = None  # nothing to hide (one sequence, one new token): let SDPA take its unmasked kernel
    device = kvs[0].device
    ids, pos = ids.to(device), pos.to(device)
    mask = mask.to(device) if mask is not None else None
    with rowexact.active(plan) if plan is not None else contextlib.nullcontext():
        out = model.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
        )
    final = out.last_hidden_state  # [B, Q, H]
    head = lm_head_fp32(model)  # [V, H] float32
    results = []
    for b, toks in enumerate(inputs):
        n = len(toks)
        # logits = h W^T computed in float32 (LM head and softmax in fp32 on every path);
        # row-exact: one [1, H] x [H, V] product per row, as a one-token step computes it, unless
        # n rows are within the head's probed invariant count (then one product is bitwise that)
        per_row = plan is not None and n > rowexact.head_rows(model)
        rows = [final[b, j : j + 1] for j in range(n)] if per_row else [final[b, :n]]
        logits = torch.cat([r.float() @ head.T for r in rows]).cpu()  # [n, V], on the host
        layers = cache.layers
        keys = [layers[i].keys[b, :, lmax : lmax + n] for i in range(len(layers))]
        values = [layers[i].values[b, :, lmax : lmax + n] for i in range(len(layers))]
        hidden = tuple(out.hidden_states[i][b, :n].cpu() for i in hidden_layers) if hidden_layers else None
        results.append(StepOutput(logits, keys, values, hidden))
    return results
