"""A lean decoder forward for Llama-shaped models on the packed CPU kernel: the same arithmetic as
HF's modules, in a fraction of the calls.

HF's decoder layer, run through the engine, makes ~45 tensor calls per layer (norms, seven
linears, RoPE through slices and a cat, views, transposes, the attention interface) and walks
the module tree in Python. On a 2-core AMD EPYC in float32 that is ~10 ms of a ~48 ms one-token
step of SmolLM2-135M. This forward does one layer as

    h = rmsnorm(x)                   ; qkv = linear(h, [Wq; Wk; Wv])    [T, (H + 2 KV) D]
    q, k = rope(q), rope(k)          ; write k, v to the pool; o = row_attention(q)
    x = x + linear(o, Wo)            ; h = rmsnorm(x); gu = linear(h, [Wg; Wu])
    x = x + linear(silu(g) * u, Wd)

with the packed kernel (csrc/packed_gemm.cpp) and the row-attention kernel (row_attn.py). Every
packed output column is its own FMA chain, so one linear over the stacked [Wq; Wk; Wv] gives
bitwise what three do, and the elementwise ops are HF's own ops in HF's order: the logits are
bitwise the HF-module path's (tests/unit/test_lean.py), so a step may take either path (a step
that asks for hidden states takes HF's) and speculation stays bitwise the target alone.
The ops around attention run in C++, two calls a layer (csrc/lean_layer.cpp's lean_pre and
lean_post, the same ATen ops in the same order as the Python they replace, shared with
lean_hf.py's bf16 forward): ~25 Python-level tensor calls a layer fewer.

The stacked weights cost no memory: they are packed once per layer, and the per-projection
packed weights HF's path reads become views of them (each projection's rows are a whole number of
16-column panels; where they are not, the model keeps HF's path).

Where it applies (`usable`): the model runs the packed kernel and the row-attention kernel
(float32 on an x86 CPU with AVX2), its layers are Llama-shaped (Llama, Qwen2, Mistral: pre-norm
RMSNorm, q/k/v/o and gate/up/down projections, SiLU, no q/k norms), and no draft int8 copies.
"""

from __future__ import annotations

import torch

from specmesh.engine import cpu_gemm, row_attn

ARCHITECTURES = ("llama", "qwen2", "mistral")
PANEL = 16  # output rows per packed panel (csrc/packed_gemm.cpp)


def llama_shaped(model: torch.nn.Module, proj_ok, layer_ok=None) -> bool:
    """Whether the model's layers are Llama-shaped (ARCHITECTURES, SiLU, pre-norm attention without
    q/k norms, q/k/v/o and gate/up/down projections) with every projection passing proj_ok(module)
    and every layer layer_ok(layer) (lean.py's forward and lean_hf.py's share this)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in ARCHITECTURES or getattr(cfg, "hidden_act", None) != "silu":
        return False
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, n) for n in ("embed_tokens", "rotary_emb", "layers", "norm")):
        return False
    for layer in inner.layers:
        a, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if a is None or mlp is None or hasattr(a, "q_norm") or hasattr(a, "k_norm"):
            return False
        if layer_ok is not None and not layer_ok(layer):
            return False
        projs = [getattr(a, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projs += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(p is None or getattr(p, "_specmesh_int8", None) is not None or not proj_ok(p) for p in projs):
            return False
    return True


def _shaped(model: torch.nn.Module) -> bool:
    """Llama-shaped, every projection on the packed kernel in whole panels."""
    return llama_shaped(model, lambda p: getattr(p, "_specmesh_packed", None) is not None
                        and not p.out_features % PANEL)


def _stack(mods: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pack [W_1; W_2; ...] once; each module's packed weight becomes its view (no second copy)."""
    ext = cpu_gemm.load()
    packed = ext.pack(torch.cat([m.weight.detach() for m in mods]))  # [P, K, 16]
    at = 0
    for m in mods:
        panels = m.out_features // PANEL
        m._specmesh_packed = packed[at : at + panels]
        at += panels
    biases = [m.bias for m in mods]
    bias = None if all(b is None for b in biases) else torch.cat(
        [b.detach() if b is not None else torch.zeros(m.out_features) for b, m in zip(biases, mods)])
    return packed, bias


def prepare(model: torch.nn.Module) -> bool:
    """Stack each layer's projections (once per model). True when the lean forward applies."""
    done = getattr(model, "_specmesh_lean", None)
    if done is not None:
        return done
    ok = bool(getattr(model, "_specmesh_cpu_gemm", False)) and _shaped(model)
    if ok:
        with torch.no_grad():
            for layer in model.model.layers:
                a, mlp = layer.self_attn, layer.mlp
                layer._specmesh_qkv = _stack([a.q_proj, a.k_proj, a.v_proj])
                layer._specmesh_gate_up = _stack([mlp.gate_proj, mlp.up_proj])
        model._specmesh_lean_layers = [_Layer(layer) for layer in model.model.layers]
    model._specmesh_lean = ok
    return ok


class _Layer:
    """One decoder layer's tensors for the forward, looked up once (not ~13 module attribute
    lookups per layer per step)."""

    __slots__ = ("norm1", "qkv", "o", "norm2", "gate_up", "down", "inter", "scale")

    def __init__(self, layer: torch.nn.Module):
        a, mlp = layer.self_attn, layer.mlp
        self.norm1 = (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon)
        self.qkv = layer._specmesh_qkv  # (packed [P, K, 16], bias or None)
        self.o = (a.o_proj._specmesh_packed, a.o_proj.bias)
        self.norm2 = (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon)
        self.gate_up = layer._specmesh_gate_up
        self.down = (mlp.down_proj._specmesh_packed, mlp.down_proj.bias)
        self.inter, self.scale = mlp.down_proj.in_features, a.scaling


def _rms(x: torch.Tensor, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """HF's RMSNorm on a float32 x: [T, hidden] (its ops, its order); norm: (weight, eps)."""
    variance = x.pow(2).mean(-1, keepdim=True)  # [T, 1]
    return norm[0] * (x * torch.rsqrt(variance + norm[1]))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb, elementwise, so q's and k's heads go through in one call.
    x: [T, heads, D]; cos, sin: [T, 1, D]."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def begin(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, hidden: dict | None) -> tuple:
    """A lean forward's start (this one's and lean_hf's): ((T, H, KV, D), the embeddings x [T, hidden],
    the hidden-state dict with index 0 filled where asked, cos and sin [T, 1, D] in x's dtype)."""
    inner, cfg = model.model, model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    x = inner.embed_tokens(ids)  # [T, hidden]
    keep = hidden if hidden is not None else {}
    if 0 in keep:
        keep[0] = x
    cos, sin = inner.rotary_emb(x[None], positions[None])  # [1, T, D] each
    return (ids.shape[0], heads, kv_heads, d), x, keep, cos[0][:, None], sin[0][:, None]


@torch.inference_mode()
def forward(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor,
            plans: list[row_attn.RowPlan], hidden: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """ids, positions: [T] long; plans: the step's row plans, covering every row (row_attn.plan)
    -> the final normed hidden states [T, hidden] float32. hidden: HF hidden_states indices to fill
    ({index: None} in, [T, hidden] out): 0 the embeddings, i the output of layer i - 1, the last
    one after the final norm, as HF's output_hidden_states gives them."""
    (t, heads, kv_heads, d), x, keep, cos, sin = begin(model, ids, positions, hidden)
    inner = model.model
    ext = cpu_gemm.load()
    for i, lay in enumerate(model._specmesh_lean_layers):
        # the norm, the stacked q/k/v call and RoPE in one C++ call (csrc/lean_layer.cpp: _rms's and
        # _rope's ops in their order, the packed kernel's linear): q [1, H, T, D], k and v [1, KV, T, D]
        q, k, v = ext.lean_pre(x, *lay.norm1, *lay.qkv, 0, 0, cos, sin, heads, kv_heads, d, 0)
        o = row_attn.step(plans, i, k, v, q, lay.scale)  # [T, H, D]: every row is on the kernel
        # o_proj and the residual, the norm, gate/up, SiLU(gate) * up, down and the residual
        x = ext.lean_post(x, o[None], *lay.o, 0, 0, *lay.norm2, *lay.gate_up, 0, 0, lay.inter, *lay.down, 0, 0, 0)
        if i + 1 in keep and i + 1 < len(inner.layers):
            keep[i + 1] = x
    final = _rms(x, (inner.norm.weight, inner.norm.variance_epsilon))  # [T, hidden]
    if len(inner.layers) in keep:
        keep[len(inner.layers)] = final
    return final
