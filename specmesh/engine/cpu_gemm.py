"""The CPU verify kernel: float32 linears from packed weights, for the few rows of a step.

On some CPUs the BLAS runs small-M float32 GEMMs far below peak: measured on a 2-core AMD EPYC
(MKL, one thread), [5, 576] x [576, 1536] costs 2.8x the one-row call and the 49152-row LM head
at 5 rows 2.5x, so a 5-position verify costs ~1.9x a one-token step. csrc/packed_gemm.cpp packs each
weight once into 32-column panels and computes 2 rows x 32 columns per tile with FMAs in
registers: 2 rows cost what 1 costs, 5 rows about half of what the BLAS needs. Each output is one
FMA chain over k in order, so a batched call is bitwise the one-row calls (row-invariant): with it
deterministic verification is free, and `batch_invariant: auto` turns it on.

A float32 model loaded from a bf16 checkpoint (SmolLM2, the Qwen2.5-Coder pair) holds only bf16
values, so `pack` stores such a weight's panels in bf16 (AVX2 builds; checked value by value, any
other weight stays float32) and the tiles widen them as they load them: every output bit is the
float32 panels', but a step streams half the bytes. Measured on a 2-core Zen 3 EPYC, one thread,
SmolLM2-135M's linears and head from DRAM, ms per pass float32 -> bf16 panels: 1 row 25.8 -> 12.1,
5 rows 29.0 -> 18.5, 9 rows 36.9 -> 32.8, 16 rows 54.9 -> 51.0 (the packed copy: 540 -> 270 MB).

The kernel is compiled on first use with torch's C++ extension loader (a C++ compiler and ninja;
`make setup` builds it once, cached under the torch extensions directory, keyed by the source's
hash). `target_worker.cpu_kernel: auto` uses it where it builds and runs: x86-64 with AVX2 and
FMA, a float32 model on the CPU; anything else (a GPU, bf16, no compiler) keeps torch's own
linears, and the worker logs which. It runs only inside engine steps (`active`), so HF's own
forward on the same model object is untouched; steps with more than MAX_ROWS rows (long prefills)
keep the BLAS, unless a deterministic step needs every row on the kernel.

`python -m specmesh.engine.cpu_gemm` builds it and prints whether it is usable here.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
import platform
import shutil
import sys
from pathlib import Path

import torch

from specmesh.engine import bf16rows, onednn
from specmesh.engine.rowprobe import packing_apply

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("packed_gemm.cpp", "row_attention.cpp", "sdpa_rows.cpp",
                                                                     "lean_layer.cpp", "bf16_rows.cpp", "exact_row.cpp",
                                                                     "row_attention_group.cpp")]
HEADERS = [Path(__file__).parent / "csrc" / "row_attention.h"]  # in the build's digest, not compiled alone
MAX_ROWS = 64  # default mode: more rows than this (a long prefill) go to the BLAS
_EXT = None
_TRIED = False
_ACTIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("specmesh_cpu_gemm", default=False)


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo (None where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return flags


def unusable_reason(cpuinfo: str | None = None) -> str | None:
    """Why the kernel cannot run on this machine (None: it can)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not x86-64 ({platform.machine()})"
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return "no /proc/cpuinfo"
    if not {"avx2", "fma"} <= flags:
        return "the CPU lacks AVX2/FMA"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler"
    try:
        import ninja  # noqa: F401
    except ImportError:
        return "ninja is not installed"
    return None


def build_flags(cpuinfo: str | None = None) -> list[str]:
    """AVX2/FMA everywhere; AVX-512 tiles where the CPU has avx512f (same arithmetic, twice the
    lanes: they matter where a step is compute-bound); AVX512-BF16 where it has that too (the bf16
    rows kernel, bf16rows.py)."""
    flags = cpu_flags(cpuinfo) or set()
    bf16 = ["-mavx512bw", "-mavx512vl", "-mavx512bf16"] if {"avx512f", "avx512bw", "avx512_bf16"} <= flags else []
    exact = ["-mavx512dq"] if bf16 and "avx512dq" in flags else []  # exact_row.cpp: ATen's AVX-512 vectors
    return ["-O3", "-mavx2", "-mfma"] + (["-mavx512f"] if "avx512f" in flags else []) + bf16 + exact


def _build_dir(name: str) -> str | None:
    """The build's folder inside the running environment (a venv's own), else torch's default.
    torch versions a build by its include paths too, so two checkouts' venvs sharing torch's
    default folder would rebuild it (~80 s) each time the other one had loaded it."""
    folder = Path(sys.prefix) / "specmesh-ext" / name
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return str(folder) if os.access(folder, os.W_OK) else None


def load():
    """The compiled extension (built on first use, then cached), or None with a logged reason."""
    global _EXT, _TRIED
    if _TRIED:
        return _EXT
    _TRIED = True
    reason = unusable_reason()
    if reason is not None:
        log.info("CPU verify kernel not used: %s", reason)
        return None
    from torch.utils.cpp_extension import load as load_ext

    flags = build_flags()
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(flags).encode()).hexdigest()[:12]
    name = f"specmesh_packed_gemm_{digest}"
    try:
        _EXT = load_ext(name, [str(p) for p in SOURCES], extra_cflags=flags, verbose=False,
                        build_directory=_build_dir(name))
    except Exception as exc:  # noqa: BLE001 - any build failure: torch's linears serve instead
        log.warning("CPU verify kernel failed to build, torch's linears serve: %s", str(exc).splitlines()[-1:])
        _EXT = None
    if _EXT is not None:
        log.info("CPU verify kernel in use (%s)", "AVX-512" if "-mavx512f" in flags else "AVX2/FMA")
    return _EXT


def in_step() -> bool:
    """Whether an engine step is running (kv.batched_step), not HF's own forward."""
    return _ACTIVE.get()


@contextlib.contextmanager
def active(on: bool = True):
    """Inside an engine step: packed linears may run the kernel."""
    token = _ACTIVE.set(on)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def packed(mod: torch.nn.Module, x: torch.Tensor, exact: bool) -> torch.Tensor | None:
    """The kernel's output for `mod` (an nn.Linear packed by install) on x [..., in], or None
    when it does not apply (outside a step, another dtype/device, too many rows for the default
    mode)."""
    wp = getattr(mod, "_specmesh_packed", None)
    if wp is None or not _ACTIVE.get() or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if not exact and x.numel() // x.shape[-1] > MAX_ROWS:
        return None
    return _EXT.linear(x, wp, mod.bias, mod.out_features)


def install(model: torch.nn.Module) -> bool:
    """Pack every decoder nn.Linear and the LM head of a float32 CPU model (kept beside the
    original weights, which HF's own forward still uses). True when the kernel is in use. A bf16
    CPU model gets oneDNN's prepacked linears instead where they are bitwise F.linear's and faster
    (onednn.py; not this kernel: still False)."""
    if getattr(model, "_specmesh_cpu_gemm", None) is not None:
        return model._specmesh_cpu_gemm
    head = model.get_output_embeddings()
    use = head.weight.dtype == torch.float32 and head.weight.device.type == "cpu" and load() is not None
    if use:
        for mod in [*model.model.modules(), head]:
            if isinstance(mod, torch.nn.Linear):
                pack_linear(mod)
    elif head.weight.dtype == torch.bfloat16 and head.weight.device.type == "cpu":
        onednn.install(model)
        bf16rows.install(model, load(), onednn.run, onednn.pack)  # decode and verify rows, where faster (and exact)
    model._specmesh_cpu_gemm = use
    return use


def pack_linear(mod: torch.nn.Linear) -> bool:
    """Pack one float32 CPU nn.Linear for the kernel (install: every linear of a model; alone:
    the block drafter's LM head, for `apply` outside engine steps). True when packed (or already)."""
    if getattr(mod, "_specmesh_packed", None) is not None:
        return True
    if mod.weight.dtype != torch.float32 or mod.weight.device.type != "cpu" or load() is None:
        return False
    with torch.no_grad():
        mod._specmesh_packed = _EXT.pack(mod.weight.detach())
    return True


def apply(mod: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """mod(x) for x [rows, in]: through the kernel where pack_linear packed mod, any row count
    (4 rows of SmolLM2's 49152-row head: 8 ms against MKL's 23, Zen 3), else mod's own forward."""
    with active():
        y = packed(mod, x, exact=True)  # exact: every row count on the kernel
    return mod(x) if y is None else y


def kernel_apply():
    """apply(x, W, b) through the kernel for rowexact's probe (packs each probe weight once). The
    probe's weights are rounded to bf16 first, so it runs the bf16 panels a bf16 checkpoint's model
    runs (the float32 panels' tiles are the same code)."""
    return packing_apply(lambda w: _EXT.pack(w.to(torch.bfloat16).float()),
                         lambda x, wp, b, w: _EXT.linear(x, wp, b, w.shape[0]), "packed kernel")


def packed_bytes(model: torch.nn.Module) -> int:
    """Bytes of the packed weights (0 when not installed)."""
    mods = [m for m in model.modules() if getattr(m, "_specmesh_packed", None) is not None]
    return sum(m._specmesh_packed.numel() * m._specmesh_packed.element_size() for m in mods)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    ext = load()
    if ext is None:
        print(f"specmesh: CPU verify kernel not usable here: {unusable_reason() or 'build failed'}")
        return 0
    w, x = torch.randn(40, 24), torch.randn(5, 24)
    y = ext.linear(x, ext.pack(w), None, 40)
    ok = torch.allclose(y, x @ w.T, atol=1e-4) and all(
        torch.equal(y[i : i + 1], ext.linear(x[i : i + 1], ext.pack(w), None, 40)) for i in range(5))
    print(f"specmesh: CPU verify kernel built and {'checked' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
