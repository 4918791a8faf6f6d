"""Norms in deterministic steps (rowexact's `true` / `own`). A norm (RMSNorm, LayerNorm) is a
per-row reduction: on a CPU its rows do not depend on how many a call holds, but a GPU's reduction
kernel may split a row's sum differently for few rows than for many (an H200 in float32: bitwise
its one-row calls only up to 7 rows; docs/bench/engine.md#11b). rowexact.install probes each norm
here as it probes linears, and steps under rows(1 or 2) run it in chunks of its count."""

from __future__ import annotations

import types

import torch

from specmesh.engine.rowprobe import _ACTIVE, PROBE_ROWS, PROBE_TRIALS, _wide, invariant_rows, pow2_floor


def norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's per-row norms with a weight (HF's RMSNorm / LayerNorm modules, any model
    family; the probe takes its dtype, device and width from the weight. A norm without one, a
    LayerNorm with elementwise_affine=False, is not probed and runs whole)."""
    return [m for m in model.model.modules() if type(m).__name__.endswith(("RMSNorm", "LayerNorm"))
            and isinstance(getattr(m, "weight", None), torch.Tensor)]


def norm_count(mod: torch.nn.Module) -> int:
    """The norm's invariant row count over PROBE_TRIALS wide-range draws, power of two. Each draw
    also runs the module's own forward on the rows in float32 (HF's RMSNorm sums in float32
    whatever its dtype): in bf16 the output's rounding hides a float32 sum's other order on
    most rows, not on all (an H200: the bf16 module probed 64 rows, its float32 sum 7)."""
    w, own = mod.weight, type(mod).forward
    counts = []
    with torch.no_grad():
        for t in range(PROBE_TRIALS):
            x = _wide((PROBE_ROWS + 1, w.shape[0]), w, torch.Generator().manual_seed(t))  # [65, H]
            counts.append(invariant_rows(lambda r: own(mod, r), x))
            if w.dtype != torch.float32:
                try:
                    counts.append(invariant_rows(lambda r: own(mod, r.float()), x))
                except RuntimeError:  # a norm that takes only its own dtype (LayerNorm): that probe alone
                    pass
    return pow2_floor(min(counts))


def probe_norms(model: torch.nn.Module) -> None:
    """Set ``_specmesh_rows`` on every decoder norm (one probe per class / shape / dtype / device)
    and the model's fewest (norm_rows); route through norm_forward the norms probed short of
    PROBE_ROWS. A norm invariant to the probe's limit runs whole, in every step, with no wrapper
    (every norm on the CPUs measured: a per-row reduction on one thread)."""
    seen: dict[tuple, int] = {}
    for mod in norms(model):
        w = mod.weight
        key = (type(mod), tuple(w.shape), w.dtype, str(w.device))
        if key not in seen:
            seen[key] = norm_count(mod)
        mod._specmesh_rows = seen[key]
        if mod._specmesh_rows < PROBE_ROWS and not getattr(mod, "_specmesh_routed", False):
            mod.forward = types.MethodType(norm_forward, mod)
            mod._specmesh_routed = True
    model._specmesh_norm_rows = min(seen.values(), default=PROBE_ROWS)


def norm_rows(model: torch.nn.Module) -> int:
    """The fewest rows any probed norm of the model is invariant to (PROBE_ROWS where none is
    probed): read per step (kv._lean_ok), so kept on the model by probe_norms."""
    return getattr(model, "_specmesh_norm_rows", PROBE_ROWS)


def norm_forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x: [..., H] -> [..., H]: the module's own forward; inside a deterministic step in chunks
    of its probed invariant row count (one row per call where the probe found none; whole at
    PROBE_ROWS)."""
    own = type(self).forward
    if not _ACTIVE.get():
        return own(self, x)
    step = max(1, getattr(self, "_specmesh_rows", 0))
    x2 = x.reshape(-1, x.shape[-1])  # [M, H]
    if step >= PROBE_ROWS or x2.shape[0] <= step:
        return own(self, x)
    return torch.cat([own(self, x2[i : i + step]) for i in range(0, x2.shape[0], step)]).view(x.shape)
