"""A lean decoder forward for Llama-shaped models off the packed CPU kernel (bf16, or any dtype on
any device): HF's modules' ops, in HF's order, on the step's own linears and attention, without
walking the module tree.

HF's decoder layer, run through the engine, spends more of a small model's step in Python than
in the arithmetic outside its linears: module calls, keyword plumbing, the attention-interface
lookup, views and transposes. Measured on a 2-core Intel Xeon with AMX, bf16, one thread, SmolLM2-
135M, a one-token step of 43.5 ms: its 211 prepacked linears 26 ms, every other op 8 ms, and ~9.5 ms
outside any op. lean.py removes that for float32 on the packed kernel; this does it for the other
models, where the linears are the routed ones (rowexact.linear_forward: oneDNN's prepacked call, the
deterministic chunks, HF's F.linear) and attention is the pool's (kv.pool_attention).

Bitwise HF's modules (tests/unit/test_lean_hf.py compares logits and hidden states of every step
kind in both modes): each linear is the very function the routed module runs, on the same [T, in]
rows; the norms, RoPE, SiLU, products and residual adds are HF's ops in HF's order and dtypes
(elementwise ops give every element the same value whatever the layout, and RoPE's q and k heads
go through one call for that reason); attention is the same pool_attention call.

Where it applies (`usable`): Llama, Qwen2 and Mistral layers (pre-norm RMSNorm, q/k/v/o and
gate/up/down projections, SiLU, no q/k norms), not on the packed kernel (lean.py's), no draft int8
copies (quant.py: a module the step routes elsewhere), and only inside batched_step.
"""

from __future__ import annotations

import torch

from specmesh.engine import bf16rows, cpu_gemm, lean, onednn, onednn_stack
from specmesh.engine.rowexact import chunking, linear_forward
from specmesh.engine.rowprobe import _ACTIVE

STACK = True  # q/k/v and gate/up as one prepacked call each (onednn_stack.Stack), where bitwise
CPP = True  # a layer's ops around attention in two C++ calls (csrc/lean_layer.cpp), where they apply
NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")  # the forward _rms repeats


def _shaped(model: torch.nn.Module) -> bool:
    """Llama-shaped (lean.llama_shaped) with HF's RMSNorms and every projection a routed linear,
    and not on the packed kernel (lean.py's forward, or HF's where that does not fit)."""
    inner = getattr(model, "model", None)
    if getattr(model, "_specmesh_cpu_gemm", False) or type(getattr(inner, "norm", None)).__name__ not in NORMS:
        return False
    norms = ("input_layernorm", "post_attention_layernorm")
    return lean.llama_shaped(model, lambda p: isinstance(p, torch.nn.Linear) and getattr(p, "_specmesh_routed", False),
                             lambda layer: all(type(getattr(layer, n, None)).__name__ in NORMS for n in norms))


class _Layer:
    """One decoder layer's modules and tensors, looked up once."""

    __slots__ = ("idx", "norm1", "q", "k", "v", "o", "norm2", "gate", "up", "down", "act", "scale", "qkv", "gate_up",
                 "silu")

    def __init__(self, model: torch.nn.Module, layer: torch.nn.Module):
        a, mlp = layer.self_attn, layer.mlp
        self.idx = a.layer_idx
        self.norm1 = layer.input_layernorm
        self.q, self.k, self.v, self.o = a.q_proj, a.k_proj, a.v_proj, a.o_proj
        self.norm2 = layer.post_attention_layernorm
        self.gate, self.up, self.down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act, self.scale = mlp.act_fn, a.scaling
        self.silu = isinstance(self.act, torch.nn.SiLU) or type(self.act).__name__ == "SiLUActivation"
        self.qkv = onednn_stack.stack(model, [self.q, self.k, self.v]) if STACK else None  # one prepacked call each, where bitwise
        self.gate_up = onednn_stack.stack(model, [self.gate, self.up]) if STACK else None


def prepare(model: torch.nn.Module) -> bool:
    """Look each layer up once per model. True when the lean forward applies."""
    done = getattr(model, "_specmesh_lean_hf", None)
    if done is None:
        done = _shaped(model)
        if done:
            model._specmesh_lean_hf_layers = [_Layer(model, layer) for layer in model.model.layers]
            if any(lay.qkv is not None or lay.gate_up is not None for lay in model._specmesh_lean_hf_layers):
                onednn_stack.release()
        model._specmesh_lean_hf = done
    return done


def _rms(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """HF's RMSNorm (its ops, its order, its dtypes); x: [T, hidden] in the model's dtype. A norm
    that deterministic steps run in chunks (rownorm.norm_forward: probed short of its limit, a
    GPU's) takes its routed forward."""
    if getattr(norm, "_specmesh_routed", False):
        return norm.forward(x)
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)  # [T, 1]
    return norm.weight * (h * torch.rsqrt(variance + norm.variance_epsilon)).to(x.dtype)


def _linears(st: onednn_stack.Stack | None, mods: tuple, x: torch.Tensor) -> list[torch.Tensor]:
    """The members' outputs on x [T, in]: column slices of one stacked call where the step would run
    every member from its prepacked weight alike, else each member's own routed call."""
    out = None
    if st is not None:
        if not _ACTIVE.get():
            out = onednn.packed(st, x)  # None past equal_rows in a step with a prefill (members: F.linear)
        elif st.same_chunks():
            out = linear_forward(st, x)  # the deterministic chunks every member would run
    if out is None:
        return [linear_forward(m, x) for m in mods]
    return [out[:, lo:hi] for lo, hi in st.cols]


def _layer(lay: _Layer, x: torch.Tensor, cos, sin, attend, dims: tuple[int, int, int, int]) -> torch.Tensor:
    """One decoder layer in Python: x [T, hidden] -> [T, hidden]."""
    t, heads, kv_heads, d = dims
    h = _rms(x, lay.norm1)  # [T, hidden]
    q, k, v = _linears(lay.qkv, (lay.q, lay.k, lay.v), h)  # [T, H D], [T, KV D] x 2
    q, k, v = q.view(t, heads, d), k.view(t, kv_heads, d), v.view(t, kv_heads, d)
    qk = lean._rope(torch.cat((q, k), dim=1), cos, sin)  # [T, H + KV, D]
    o = attend(lay.idx, qk[:, :heads].transpose(0, 1)[None], qk[:, heads:].transpose(0, 1)[None],
               v.transpose(0, 1)[None], lay.scale)  # [1, T, H, D]
    x = x + linear_forward(lay.o, o.reshape(t, heads * d))
    h = _rms(x, lay.norm2)
    gate, up = _linears(lay.gate_up, (lay.gate, lay.up), h)  # [T, I] each
    return x + linear_forward(lay.down, lay.act(gate) * up)


def _cpp_plan(lay: _Layer, t: int) -> tuple[list[tuple[int, int]], tuple, int] | None:
    """(per call (rows per call, row floor), weights, K block) of the layer's four prepacked calls
    (q/k/v, o, gate/up, down) as this step would route them (step 0: one call): the bf16 rows
    kernel's copies and block where all four take it (bf16rows.route), else oneDNN's (block 0,
    unused); or None where the C++ halves do not apply: a projection not prepacked or not stacked,
    a prefill past a weight's equal_rows (F.linear's), a stack whose members a deterministic step
    would chunk apart, a non-SiLU activation, a routed norm."""
    kinds = (lay.qkv, lay.o, lay.gate_up, lay.down)
    if lay.qkv is None or lay.gate_up is None or not lay.silu or not (onednn.is_own(lay.o) and onednn.is_own(lay.down)):
        return None
    if getattr(lay.norm1, "_specmesh_routed", False) or getattr(lay.norm2, "_specmesh_routed", False):
        return None  # a norm a deterministic step runs in chunks (rownorm): Python's _rms routes it
    active = _ACTIVE.get()
    found = _kernel(lay, t, bool(active))
    if found is not None:  # every row on the rows kernel: one call each
        return [(0, 1)] * 4, *found
    onednn_w = tuple(k._specmesh_onednn for k in kinds)
    if not active:
        if onednn.in_prefill() and t > min(k._specmesh_onednn_equal for k in kinds):
            return None
        return [(0, 1)] * 4, onednn_w, 0
    if not (lay.qkv.same_chunks() and lay.gate_up.same_chunks()):
        return None
    return [chunking(getattr(k, "_specmesh_rows", 0), getattr(k, "_specmesh_rows2", 0), active) for k in kinds], onednn_w, 0


def _kernel(lay: _Layer, t: int, det: bool) -> tuple | None:
    """The bf16 rows kernel's four copies (q/k/v, o, gate/up, down) and their K block, where a call
    of t rows of each takes it (bf16rows.route: all four, one block), else None."""
    routes = [bf16rows.route(k, t, onednn.in_prefill(), det) for k in (lay.qkv, lay.o, lay.gate_up, lay.down)]
    if any(r is None or r[2] is not None for r in routes) or len({r[1] for r in routes}) != 1:
        return None
    return tuple(r[0]._specmesh_bf16rows for r in routes), routes[0][1]


@torch.inference_mode()
def forward(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor, attend,
            hidden: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """ids, positions: [T] long; attend(layer_idx, q [1, H, T, D], k, v [1, KV, T, D], scale) ->
    [1, T, H, D] (kv.pool_attention's) -> the final normed hidden states [T, hidden] in the model's
    dtype. hidden: as lean.forward's (HF's output_hidden_states indices)."""
    (t, heads, kv_heads, d), x, keep, cos, sin = lean.begin(model, ids, positions, hidden)
    inner = model.model
    ext = cpu_gemm.load() if CPP and x.device.type == "cpu" else None
    for i, lay in enumerate(model._specmesh_lean_hf_layers):
        plan = _cpp_plan(lay, t) if ext is not None else None
        if plan is not None:  # the same ops in C++ (csrc/lean_layer.cpp), attention still attend's
            ((s1, f1), (so, fo), (sg, fg), (sd, fd)), (w1, wo, w2, wd), kc = plan
            n1, n2, st1, st2 = lay.norm1, lay.norm2, lay.qkv, lay.gate_up
            q, k, v = ext.lean_pre(x, n1.weight, n1.variance_epsilon, w1, st1.bias, s1, f1, cos, sin, heads, kv_heads, d,
                                   kc)
            o = attend(lay.idx, q, k, v, lay.scale)  # [1, T, H, D]
            x = ext.lean_post(x, o, wo, lay.o.bias, so, fo, n2.weight, n2.variance_epsilon, w2, st2.bias, sg, fg,
                              lay.gate.out_features, wd, lay.down.bias, sd, fd, kc)
        else:
            x = _layer(lay, x, cos, sin, attend, (t, heads, kv_heads, d))
        if i + 1 in keep and i + 1 < len(inner.layers):
            keep[i + 1] = x
    final = _rms(x, inner.norm)  # [T, hidden]
    if len(inner.layers) in keep:
        keep[len(inner.layers)] = final
    return final
