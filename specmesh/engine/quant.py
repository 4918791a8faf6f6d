"""Weight-only int8 linears for a draft model: half the bytes a drafted token reads.

A draft model's outputs only steer which tokens the target verifies, so its weights may be
approximated without changing a single emitted token (the target's verification, or its
rejection sampler at T > 0, decides what is kept): what it costs is acceptance, what it buys is a
cheaper drafted token. On a CPU a one-token step is bound by memory traffic (measured on a 2-core
Zen 4: the 0.5B draft's bf16 GEMMs move ~7.5 GB/s, 77% of its step), so int8 weights with one
scale per output row (symmetric, absmax / 127) read half the bytes of bf16 for the same matmuls.

Each quantized linear keeps its model-dtype weight beside the int8 copy (the draft costs 1.5x its
weight bytes): steps of at most `ROWS` rows (drafting: one row per running proposal) take torch's
int8 kernel (`aten._weight_int8pack_mm`), longer ones (a prefill) the model's own GEMM, which is
faster there. Only engine steps read the copies: rowexact.linear_forward (the engine's routing of
every decoder linear) and kv.lm_head ask `apply`; HF's own forward on the same model keeps the
model's weights. The embedding lookup reads one row per token and is left alone. `quantize`
probes the kernel per distinct shape on the model's device and dtype and leaves a linear as it
was where the kernel is missing or wrong, so a device without it drafts in the model's dtype (the
draft worker logs which).
"""

from __future__ import annotations

import torch

from specmesh.engine import cpu_gemm

ROWS = 8  # at most this many rows read the int8 weights (the mesh runs used 8; the micro on Zen 4
# found 5-8 row steps slower than bf16, so 4 may suit it better: docs/pair.md)
_TOL = 0.05  # probe: the kernel within 5% of the dequantised product's scale


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight: [N, K] -> (int8 [N, K], scales [N] in the weight's dtype): w ~ q * scale per row."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [N]
    q = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)  # [N, K]
    return q.contiguous(), scales.to(weight.dtype)


def _int8_mm(x2: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x2, q, scales)  # [M, K] x [N, K]^T -> [M, N]


def _kernel_ok(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the int8 kernel runs on this device/dtype/shape and matches the dequantised product."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, q.shape[1], generator=gen).to(device=q.device, dtype=dtype)  # [3, K]
    try:
        got = _int8_mm(x, q, scales).float()  # [3, N]
    except (RuntimeError, NotImplementedError):
        return False
    want = (x.float() @ (q.float() * scales.float()[:, None]).T)  # [3, N]
    return bool((got - want).abs().max() <= _TOL * want.abs().max().clamp(min=1e-6))


def apply(mod: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """The int8 product of a quantized linear on x [..., K] -> [..., N] (float of x's dtype), or None
    where it does not apply (not quantized, more than ROWS rows, or outside an engine step)."""
    q = getattr(mod, "_specmesh_int8", None)
    if q is None or x.numel() // x.shape[-1] > ROWS or x.dtype != q[1].dtype or not cpu_gemm.in_step():
        return None
    out = _int8_mm(x.reshape(-1, x.shape[-1]), *q).view(*x.shape[:-1], -1)
    return out + mod.bias if mod.bias is not None else out


def quantize(model: torch.nn.Module) -> int:
    """Give every decoder nn.Linear and the LM head an int8 copy (probed per shape; see the
    module docstring). Returns the int8 bytes added (0: the kernel is unusable here). Idempotent."""
    if getattr(model, "_specmesh_int8_bytes", None) is not None:
        return model._specmesh_int8_bytes
    ok: dict[tuple, bool] = {}
    added = 0
    head = model.get_output_embeddings()
    with torch.no_grad():
        for mod in [*model.model.modules(), head]:
            if not isinstance(mod, torch.nn.Linear) or hasattr(mod, "_specmesh_int8"):
                continue
            q, scales = quantize_rows(mod.weight)
            key = (tuple(q.shape), mod.weight.dtype, str(mod.weight.device))
            if key not in ok:
                ok[key] = _kernel_ok(q, scales, mod.weight.dtype)
            if not ok[key]:
                continue
            mod._specmesh_int8 = (q, scales)
            added += q.numel() + scales.numel() * scales.element_size()
    model._specmesh_int8_bytes = added
    return added
