"""DFlash-style block drafter with a DSpine-style causal-injection switch.

One forward drafts a whole block of ``B = block_size`` positions in parallel.

Inputs (per sequence), with ``T`` accepted tokens so far and the target's bonus
token ``x_T`` (sampled by the target from its logits at position ``T - 1``):

* context features ``c_j = concat_l hidden^target_l(x_j)`` for the last
  ``C <= context_window`` accepted positions ``j = T-C .. T-1`` (see
  :mod:`specmesh.drafters.features` for the exact layers);
* block tokens ``[x_T, MASK, ..., MASK]`` (``B`` ids) embedded with the TARGET's
  frozen embedding.

What each block position predicts: position 0 holds the known token ``x_T`` and its
output is unused; position ``k = 1 .. B-1`` predicts ``x_{T+k}``. So one forward
yields a draft of ``B - 1`` tokens ``x_{T+1} .. x_{T+B-1}``.

Attention: every block query attends to all (valid) projected context positions
plus all ``B`` block positions (bidirectional inside the block); context
positions are keys/values only, shared by every layer (each layer applies its own
k/v projections to the same ``ctx = RMSNorm(W_fc c)``). Positions use RoPE with
the last context position at ``C - 1`` and block position ``k`` at ``C + k``; since
RoPE scores depend only on offsets, this matches the target's absolute positions
(``T - C + j`` and ``T + k``) up to a constant shift.

Causal injection (``causal_injection=True``), after every layer ``l``:
``h_t <- h_t + sigmoid(g_l) * U_l V_l h_{t-1}`` for ``t >= 1`` (rank ``r``), so later
block positions read an explicit summary of the previous position's (prediction)
state while all positions still run in one parallel pass. ``U_l`` is zero-initialised,
so a fresh injecting drafter computes exactly what the non-injecting one does; the
scalar gate ``g_l`` starts at 0 (``sigmoid = 0.5``).

The target's embedding and LM head are shared, frozen and NOT part of this
module's ``state_dict`` (they are held outside the module registry).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.drafters.features import extract_target_features

__all__ = ["BlockDrafterConfig", "BlockDrafter", "extract_target_features", "top_k_per_position"]


@dataclass(frozen=True)
class BlockDrafterConfig:
    target_layers: tuple[int, ...] = (1, 14, 27)
    target_hidden_size: int = 576  # H of the target (per feature layer)
    hidden_size: int = 576  # must equal the target embedding width (shared embed / LM head)
    num_layers: int = 2
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1024
    block_size: int = 8
    mask_token_id: int = 0  # SmolLM2 "<|endoftext|>", never produced inside a chat turn
    causal_injection: bool = True
    injection_rank: int = 32
    context_window: int = 64
    vocab_size: int = 49152
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5

    @property
    def feature_size(self) -> int:
        return len(self.target_layers) * self.target_hidden_size

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "BlockDrafterConfig":
        d = dict(d)
        d["target_layers"] = tuple(d["target_layers"])
        return cls(**d)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [N, S] int -> cos, sin: [N, 1, S, head_dim] fp32 (llama rotate-half layout)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)
    ang = positions.float()[..., None] * inv  # [N, S, D/2]: angle_i = pos * theta^(-2i/D)
    ang = torch.cat([ang, ang], dim=-1)[:, None]  # [N, 1, S, D]
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, S, D]; cos/sin: [N, 1, S, D]. x*cos + rotate_half(x)*sin."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), masked) v with each kv head shared by a group of query heads.
    q: [N, Hq, B, D]; k, v: [N, Hkv, S, D]; mask: [N, 1, B, S] bool -> [N, Hq, B, D].
    Written out (not SDPA): at B=8 queries the CPU SDPA kernels are far slower, esp. backward."""
    n, hq, b, d = q.shape
    g = hq // k.shape[1]
    qg = q.reshape(n, k.shape[1], g * b, d)  # query heads of one group stacked on the row axis
    scores = qg @ k.transpose(-1, -2) / math.sqrt(d)  # [N, Hkv, g*B, S]
    scores = scores.masked_fill(~mask.repeat(1, 1, g, 1), float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
    return (probs @ v).reshape(n, hq, b, d)


class DrafterLayer(nn.Module):
    """Pre-norm llama block whose keys/values are [context ; block] and queries are the block."""

    def __init__(self, cfg: BlockDrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.attn_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.mlp_norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x: [N, S, n*D] -> [N, n, S, D]."""
        return x.view(x.shape[0], x.shape[1], n, self.cfg.head_dim).transpose(1, 2)

    def context_kv(self, ctx: torch.Tensor) -> torch.Tensor:
        """ctx: [..., C, H] projected context -> [..., C, 2 Hkv D]: its keys (before RoPE) and
        values. A row's depend on that row only, so a draft worker keeps them per sequence and
        projects only the rows each round adds (positions enter through RoPE, in forward)."""
        return torch.cat([self.k_proj(ctx), self.v_proj(ctx)], dim=-1)

    def forward(self, h: torch.Tensor, ctx_kv: torch.Tensor, attn_mask: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """h: [N, B, H] block stream; ctx_kv: [N, C, 2 Hkv D] the context's keys and values
        (context_kv); attn_mask: [N, 1, B, C+B] bool (True = may attend); cos/sin: [N, 1, C+B, D].
        -> [N, B, H]"""
        cfg, b = self.cfg, h.shape[1]
        kvd = cfg.num_kv_heads * cfg.head_dim
        x = self.attn_norm(h)
        keys = torch.cat([ctx_kv[..., :kvd].to(x.dtype), self.k_proj(x)], dim=1)  # [N, C+B, Hkv D]
        values = torch.cat([ctx_kv[..., kvd:].to(x.dtype), self.v_proj(x)], dim=1)  # [N, C+B, Hkv D]
        q = apply_rope(self._heads(self.q_proj(x), cfg.num_heads), cos[:, :, -b:], sin[:, :, -b:])
        k = apply_rope(self._heads(keys, cfg.num_kv_heads), cos, sin)
        v = self._heads(values, cfg.num_kv_heads)
        att = grouped_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask)  # [N, heads, B, D]
        h = h + self.o_proj(att.transpose(1, 2).reshape(h.shape[0], b, -1))
        x = self.mlp_norm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU MLP


class CausalInjection(nn.Module):
    """h_t += sigmoid(g) * U V h_{t-1} (t >= 1); U zero-init => exact no-op at init."""

    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.down = nn.Linear(hidden, rank, bias=False)  # V: H -> r
        self.up = nn.Linear(rank, hidden, bias=False)  # U: r -> H
        nn.init.zeros_(self.up.weight)
        self.gate = nn.Parameter(torch.zeros(()))  # g, scalar

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h: [N, B, H] -> [N, B, H]; position 0 receives nothing."""
        msg = self.up(self.down(h))  # [N, B, H], msg_t = U V h_t
        shifted = F.pad(msg[:, :-1], (0, 0, 1, 0))  # [N, B, H], row t = msg_{t-1}, row 0 = 0
        return h + torch.sigmoid(self.gate) * shifted


class BlockDrafter(nn.Module):
    def __init__(self, cfg: BlockDrafterConfig, embed_tokens: nn.Module, lm_head: nn.Module):
        super().__init__()
        if embed_tokens.weight.shape[1] != cfg.hidden_size:
            raise ValueError("drafter hidden_size must equal the target embedding width")
        self.cfg = cfg
        # shared with the target, frozen, deliberately kept out of the module registry
        self.__dict__["_shared"] = (embed_tokens, lm_head)
        self.fc = nn.Linear(cfg.feature_size, cfg.hidden_size, bias=False)
        self.ctx_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.injections = nn.ModuleList(
            CausalInjection(cfg.hidden_size, cfg.injection_rank) for _ in range(cfg.num_layers)
        ) if cfg.causal_injection else None
        self.final_norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 2 and not name.endswith("up.weight"):
                nn.init.normal_(p, std=0.02)
        for layer in self.layers:  # scale residual writers down with depth (GPT-2 style)
            for lin in (layer.o_proj, layer.down_proj):
                lin.weight.data.mul_(1 / math.sqrt(2 * self.cfg.num_layers))

    @property
    def embed_tokens(self) -> nn.Module:
        return self._shared[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._shared[1]

    def block_ids(self, last_token: torch.Tensor) -> torch.Tensor:
        """last_token: [N] -> [N, B] = [x_T, MASK, ..., MASK]."""
        ids = torch.full((last_token.shape[0], self.cfg.block_size), self.cfg.mask_token_id,
                         dtype=torch.long, device=last_token.device)
        ids[:, 0] = last_token
        return ids

    def context_rows(self, ctx_feats: torch.Tensor) -> torch.Tensor:
        """ctx_feats: [..., C, F] target features -> [..., C, L * 2 Hkv D]: every layer's keys
        (before RoPE) and values of those positions, each row from its own features alone."""
        dtype = self.fc.weight.dtype
        ctx = self.ctx_norm(self.fc(ctx_feats.to(dtype)).to(dtype))  # [..., C, H]
        return torch.cat([layer.context_kv(ctx) for layer in self.layers], dim=-1)

    def hidden(self, block_ids: torch.Tensor, ctx_feats: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """block_ids: [N, B]; ctx_feats: [N, C, F] (left-padded); ctx_valid: [N, C] bool.
        -> final-normed block hidden states [N, B, H]."""
        return self.hidden_from_rows(block_ids, self.context_rows(ctx_feats), ctx_valid)

    def hidden_from_rows(self, block_ids: torch.Tensor, ctx_rows: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """hidden() from the context's rows (context_rows) instead of its features: [N, C, L * 2 Hkv D]."""
        n, b = block_ids.shape
        c, width = ctx_rows.shape[1], 2 * self.cfg.num_kv_heads * self.cfg.head_dim
        h = self.embed_tokens(block_ids).to(self.fc.weight.dtype)  # [N, B, H]
        pos = torch.arange(c + b, device=h.device).expand(n, -1)  # [N, C+B], last ctx at C-1
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope_theta)
        keep = torch.cat([ctx_valid, ctx_valid.new_ones(n, b)], dim=1)  # [N, C+B]
        mask = keep[:, None, None, :].expand(n, 1, b, c + b)  # [N, 1, B, C+B]
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx_rows[..., i * width:(i + 1) * width], mask, cos, sin)
            if self.injections is not None:
                h = self.injections[i](h)
        return self.final_norm(h)

    def forward(self, block_ids: torch.Tensor, ctx_feats: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """Same inputs as :meth:`hidden` -> logits [N, B, V] fp32 via the shared LM head."""
        h = self.hidden(block_ids, ctx_feats, ctx_valid)
        return self.lm_head(h.to(self.lm_head.weight.dtype)).float()

    @torch.no_grad()
    def draft(self, last_token: torch.Tensor, ctx_feats: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """Greedy draft. last_token: [N]; ctx_feats: [N, C, F]; ctx_valid: [N, C] -> [N, B-1]."""
        logits = self(self.block_ids(last_token), ctx_feats, ctx_valid)
        return logits[:, 1:].argmax(dim=-1)


def top_k_per_position(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates for tree drafting. logits: [N, B, V] drafter output ->
    (log-probs [N, B-1, k], token ids [N, B-1, k]) for the draft positions 1..B-1,
    sorted by descending probability; row i corresponds to x_{T+1+i}."""
    logp = torch.log_softmax(logits[:, 1:].float(), dim=-1)
    return logp.topk(k, dim=-1)
