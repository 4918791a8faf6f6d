"""Prepacked linears of one input as one weight (lean_hf.py: q/k/v, gate/up), where a probe finds
each member's columns bitwise its own call's.

One oneDNN call over [W_q; W_k; W_v] reads one longer weight stream than three calls do: on a
2-core AMX Xeon, bf16, SmolLM2-135M, ~2.5 ms of a ~40 ms one-token step. The members' own
prepacked copies are dropped (onednn.py's `_call` runs a member called alone from its stack and
keeps its columns), so memory does not grow; the probe's result is kept by probecache.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from specmesh.engine import bf16rows, onednn, probecache
from specmesh.engine.rowprobe import _wide


class Stack:
    """Prepacked linears of one input as one weight [sum of outs, in] (lean_hf.py: q/k/v, gate/up),
    where stack_equal finds each member's columns bitwise its own call's. Routed like a member
    (rowexact.linear_forward reads these attributes); the members' own copies are dropped and a
    member called alone runs the stack and keeps its columns, so memory does not grow."""

    def __init__(self, mods: list[torch.nn.Linear]):
        self.mods, self.weight = mods, None  # no F.linear fallback: callers ask packed() / chunks
        biases = [m.bias for m in mods]
        self.bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        with torch.no_grad():
            self._specmesh_onednn = onednn.pack(torch.cat([m.weight.detach() for m in mods]))
        self._specmesh_onednn_equal = min(m._specmesh_onednn_equal for m in mods)
        self.cols, at = [], 0
        for m in mods:
            self.cols.append((at, at + m.out_features))
            m._specmesh_onednn_part, m._specmesh_onednn = (self, at, at + m.out_features), None
            at += m.out_features
        bf16rows.stack(self, mods)  # the members' bf16 rows kernel copies, stacked alike

    @property
    def _specmesh_rows(self) -> int:  # rowexact's probed counts (read per step: the probe may come later)
        return min(getattr(m, "_specmesh_rows", 0) for m in self.mods)

    @property
    def _specmesh_rows2(self) -> int:
        return min(getattr(m, "_specmesh_rows2", 0) for m in self.mods)

    def same_chunks(self) -> bool:
        """Whether a deterministic step chunks every member alike (else members run alone)."""
        return len({(getattr(m, "_specmesh_rows", 0), getattr(m, "_specmesh_rows2", 0)) for m in self.mods}) == 1


STACK_PROBE_ROWS = 128  # rowprobe.PROBE_PACKED_ROWS: the most rows a deterministic chunk runs
STACK_TRIALS = 2
_STACK_OK: dict[tuple, bool] = {}


def stack_equal(mods: list[torch.nn.Linear], rows: int = STACK_PROBE_ROWS) -> bool:
    """Whether one prepacked call over the members' stacked weights gives each member's columns
    bitwise, at every row count a call runs (bucket(m), m <= rows), on wide-range draws. Kept by
    probecache: its calls leave oneDNN a primitive per bucket and shape (~130 MB for SmolLM2's two
    stacks on an AMX Xeon), which a start with the result cached does not pay."""
    key = tuple((tuple(m.weight.shape), m.bias is not None) for m in mods) + (mods[0].weight.dtype,)
    if key not in _STACK_OK:
        args = {"members": [[probecache.tensor_key(m.weight), probecache.tensor_key(m.bias)] for m in mods],
                "rows": rows, "trials": STACK_TRIALS}
        _STACK_OK[key] = bool(probecache.cached("onednn.stack_equal", args, mods[0].weight.device,
                                                lambda: _stack_probe(mods, rows)))
    return _STACK_OK[key]


def _stack_probe(mods: list[torch.nn.Linear], rows: int) -> bool:
    w0 = mods[0].weight
    with torch.no_grad():
        for t in range(STACK_TRIALS):
            gen = torch.Generator().manual_seed(2000 + t)
            ws = [_wide(tuple(m.weight.shape), w0, gen) for m in mods]
            bs = [_wide((m.out_features,), w0, gen) if m.bias is not None else None for m in mods]
            x = _wide((rows, w0.shape[1]), w0, gen)
            alone, whole = [onednn.pack(w) for w in ws], onednn.pack(torch.cat(ws))
            bias = None if bs[0] is None else torch.cat(bs)
            for m in sorted({onednn.bucket(m) for m in range(1, rows + 1)}):
                want = torch.cat([onednn.run(x[:m], wp, b) for wp, b in zip(alone, bs)], 1)
                if not torch.equal(onednn.run(x[:m], whole, bias), want):
                    return False
    return True


def stack(model: torch.nn.Module, mods: list[torch.nn.Linear]) -> Stack | None:
    """A Stack of mods (prepacked alone, one input width, biases all or none) where stack_equal
    holds, kept on the model (packed_bytes); else None and the members stay as they are. The same
    members asked again: their Stack."""
    part = getattr(mods[0], "_specmesh_onednn_part", None)
    if part is not None and part[0].mods == list(mods):
        return part[0]
    if not all(getattr(m, "_specmesh_onednn", None) is not None for m in mods) or \
            len({m.in_features for m in mods}) != 1 or len({m.bias is None for m in mods}) != 1:
        return None
    if not stack_equal(mods):
        return None
    st = Stack(mods)
    model.__dict__.setdefault("_specmesh_onednn_stacks", []).append(st)
    return st


def release() -> None:
    """Hand the members' dropped copies back to the OS: glibc keeps freed blocks of this size in its
    heap (SmolLM2-135M: ~70 MB of RSS until trimmed). A no-op without glibc."""
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
