"""Start-up probe results kept on disk, so a worker that starts again on the same machine does not
probe again.

The bitwise probes (rowexact's row-invariant counts, onednn's rows equal to F.linear's) find out
which kernels the libraries pick, and those depend on the shape, strides, dtype, device, thread
count, the CPU and the libraries' code, never on the weights' values: the probes draw their own
wide-range data from fixed seeds. They cost, on a 2-core AMD EPYC (Zen 4), bf16, one thread: a
target worker of SmolLM2-135M started in 22.1 s without this cache and 6.7 s with it, one of
Qwen2.5-Coder-1.5B in 238 s and 24.7 s (docs/engine.md#probe-cache).

A result is kept under everything it depends on: the machine and software (the fingerprint: the
CPU's model name, family, model, stepping, microcode and flags from /proc/cpuinfo; torch's version
and build configuration; the torch thread count; the source of the probing modules and of the
extension), and the probe's own arguments (kind, shape, strides, dtype, bias, the kernel probed,
rows, trials, row floor). Change any of them and the probe runs again; nothing is assumed across
machines or versions. Speed probes (onednn's gain, attention's fold) are timings and always run.

Where: ``$SPECMESH_PROBE_CACHE`` (a folder; ``off``, ``0`` or empty: probe at every start), by
default ``$SPECMESH_HOME/probes`` (``~/.cache/specmesh/probes``), one JSON file per fingerprint,
written atomically; an unreadable file counts as empty. CPU probes only: on a GPU they run every
start.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "SPECMESH_PROBE_CACHE"
_ENGINE = Path(__file__).parent
# what the probes run: their code and the extension's (a change in any re-probes)
SOURCES = ("probecache.py", "rowprobe.py", "rowexact.py", "rownorm.py", "onednn.py", "onednn_stack.py", "cpu_gemm.py", "bf16rows.py",
           "rowgroup.py")


def folder() -> Path | None:
    """The cache folder, or None where caching is off."""
    value = os.environ.get(ENV)
    if value is None:
        from specmesh.engine.fetch import default_home

        return default_home() / "probes"
    if value.strip().lower() in ("", "0", "off", "false", "no"):
        return None
    return Path(value)


@functools.lru_cache(maxsize=1)
def _machine() -> str:
    """The CPU's identity lines from /proc/cpuinfo (first processor; '' where unreadable)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    keep = ("vendor_id", "cpu family", "model", "model name", "stepping", "microcode", "flags")
    lines = []
    for line in text.split("\n\n")[0].splitlines():
        name = line.split(":", 1)[0].strip()
        if name in keep:
            lines.append(line.strip())
    return "\n".join(lines)


@functools.lru_cache(maxsize=1)
def _code() -> str:
    """The probing modules' and the extension's source, hashed."""
    h = hashlib.sha256()
    paths = [_ENGINE / name for name in SOURCES] + sorted((_ENGINE / "csrc").glob("*"))
    for path in paths:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def fingerprint() -> str:
    """The machine, the software and the thread count, hashed (the cache file's name)."""
    return _fingerprint(torch.get_num_threads())


@functools.lru_cache(maxsize=8)
def _fingerprint(threads: int) -> str:
    parts = [_machine(), torch.__version__, torch.__config__.show(), str(threads), _code()]
    return hashlib.sha256("\n--\n".join(parts).encode()).hexdigest()[:24]


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


_UNWRITABLE: set[Path] = set()  # folders a write failed in (warned once; probes still run)


def _write(path: Path, data: dict) -> None:
    if path.parent in _UNWRITABLE:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: probes still run, every start
        _UNWRITABLE.add(path.parent)
        log.warning("probe cache not written (%s): %s; probing at every start", path, exc)


def tensor_key(t: torch.Tensor | None) -> list | None:
    """What a probe takes from a tensor it imitates: shape, strides, dtype, device."""
    if t is None:
        return None
    return [list(t.shape), list(t.stride()), str(t.dtype), str(t.device)]


def cached_for(kind: str, weight: torch.Tensor, bias: torch.Tensor | None, compute, **args):
    """cached() for a probe that imitates weight (and bias): keyed by their shape, strides, dtype
    and device, and by args (rows, trials, ...)."""
    key = {"weight": tensor_key(weight), "bias": tensor_key(bias), **args}
    return cached(kind, key, weight.device, compute)


def cached(kind: str, args: dict, device: torch.device | str, compute):
    """compute()'s JSON-able result, from the cache where this probe ran before on this machine
    and software (module docstring), else computed and kept."""
    where = folder()
    if where is None or torch.device(device).type != "cpu":
        return compute()
    path = where / f"{fingerprint()}.json"
    key = kind + " " + json.dumps(args, sort_keys=True)
    data = _read(path)
    if key in data:
        return data[key]
    value = compute()
    data = _read(path)  # another worker may have written meanwhile
    data[key] = value
    _write(path, data)
    return value
