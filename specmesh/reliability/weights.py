"""The changed-weights fault: a target worker is restarted on a copy of its model whose weight file
was changed, twice, then on its own model again:

1. changed bytes, manifest kept (a corrupted or tampered file): the worker must refuse to start;
2. changed bytes, manifest rebuilt (another model, or a rebuilt cache): it starts and registers,
   and the coordinators must never route to it (its fingerprint is not theirs), so no output changes;
3. its own model again: it serves, the episode ends when it is back."""

from __future__ import annotations

import shutil
import signal
import time
from pathlib import Path

from specmesh.engine.manifest import model_fingerprint, write_manifest


def changed_copy(model_dir: Path, dest: Path) -> Path:
    """A copy of model_dir with 64 bytes of model.safetensors' tensor data inverted."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(model_dir, dest)
    weights = dest / "model.safetensors"
    with open(weights, "r+b") as f:
        f.seek(-4096, 2)
        data = f.read(64)
        f.seek(-4096, 2)
        f.write(bytes(b ^ 0xFF for b in data))
    return dest


def _stop(child, timeout_s: float = 60.0) -> None:
    if child.proc.poll() is None:
        child.proc.send_signal(signal.SIGTERM)  # drains: its sequences move or finish first
        child.proc.wait(timeout_s)


def _log_tail(child, since: int) -> str:
    return child.log_path.read_bytes()[since:].decode(errors="replace") if child.log_path else ""


def changed_weights_episode(mesh, name: str, hold_s: float) -> list[str]:
    from specmesh.engine.loader import resolve_model_dir
    from specmesh.reliability.faults import _child, wait_back

    notes = []
    own = resolve_model_dir(mesh.cfg.model.name, mesh.cfg.model.path)
    copy = changed_copy(own, mesh.workdir / "changed-model")
    _stop(_child(mesh, name))
    size = _child(mesh, name).log_path.stat().st_size
    child = mesh.launcher.respawn(name, {"SPECMESH_MODEL__PATH": str(copy)})
    code = child.proc.wait(300)
    refusal = next((line for line in _log_tail(child, size).splitlines() if "refusing to start" in line), "")
    notes.append(f"changed bytes, manifest kept: exit {code}, {refusal[:160] or 'no refusal logged'}")

    write_manifest(copy)
    coord_logs = {c.name: c.log_path.stat().st_size for c in mesh.launcher.children if c.service == "coordinator"}
    mesh.launcher.respawn(name, {"SPECMESH_MODEL__PATH": str(copy)})
    wait_back(mesh, name)
    time.sleep(hold_s)  # it serves (registered) while the load runs
    refused = [n for n, at in coord_logs.items()
               if "not this coordinator's" in _log_tail(_child(mesh, n), at)]
    notes.append(f"changed bytes, manifest rebuilt ({model_fingerprint(copy)} vs {model_fingerprint(own)}): started "
                 f"and registered; coordinators that refused it: {len(refused)} of {len(coord_logs)}")
    _stop(_child(mesh, name))
    mesh.launcher.respawn(name)
    shutil.rmtree(copy, ignore_errors=True)
    return notes
