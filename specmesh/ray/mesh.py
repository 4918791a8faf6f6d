"""The mesh on Ray: each service replica is a detached Ray actor that owns one service process.

An actor holds its tier's resource request (num_gpus and/or custom resources such as
`draft_gpu` / `target_gpu`, num_cpus), so Ray places it; it starts `python -m <service>` with
the actor's environment (CUDA_VISIBLE_DEVICES as Ray set it, plus the driver's SPECMESH_* /
OTEL_* / TRACEPARENT, see env.py) and the mesh config shipped as text. Workers register in the
registry (Redis) with the address the actor advertises, so scaling a tier is just adding or
removing actors; a service process that dies takes its actor down and Ray restarts it
(max_restarts). A detached controller actor ("specmesh-controller" in namespace "specmesh")
keeps the replica lists, so `specmesh ray status|scale|down` work from any later driver.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import ray

from specmesh.procutil import stop_process
from specmesh.ray.spec import START_ORDER, RayMeshSpec, TierSpec
from specmesh.registry.local_redis import free_port

log = logging.getLogger(__name__)

NAMESPACE = "specmesh"
CONTROLLER = "specmesh-controller"
MODULES = {"target": "target_worker.server", "draft": "draft_worker.server",
           "coordinator": "coordinator.server", "gateway": "gateway.server"}
SCALABLE = ("draft", "target")
__all__ = ["RayMeshSpec", "TierSpec", "up", "down", "status", "scale", "controller"]


class ServiceActor:
    """One replica: starts the service process, reports it, stops it (SIGTERM: the service drains)."""

    def __init__(self, tier: str, index: int, spec: dict, port: int = 0, extra_env: dict | None = None):
        self.tier, self.index = tier, index
        node_ip = ray.util.get_node_ip_address()
        host = spec.get("host") or node_ip
        listen_host = spec.get("host") or "0.0.0.0"
        self.port = port or free_port(listen_host)
        self.address = f"{host}:{self.port}"
        self.workdir = Path(tempfile.mkdtemp(prefix=f"specmesh-{tier}-{index}-"))
        cmd = [sys.executable, "-m", MODULES[tier], "--listen", f"{listen_host}:{self.port}"]
        if spec.get("config_text"):
            (self.workdir / "config.yaml").write_text(spec["config_text"])
            cmd += ["--config", str(self.workdir / "config.yaml")]
        env = dict(os.environ)  # includes CUDA_VISIBLE_DEVICES when Ray assigned GPUs
        env.update(spec.get("env") or {})
        env.update(extra_env or {})
        self.env = env
        env.update(SPECMESH_REGISTRY__URL=spec["redis_url"], SPECMESH_REGISTRY__ADVERTISE_HOST=host)
        self.log_path = self.workdir / "service.log"
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.node_ip = node_ip
        self._stopping = False
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        rc = self.proc.wait()
        if not self._stopping:  # the service died: take the actor down so Ray restarts it
            print(f"specmesh {self.tier}-{self.index}: service exited with {rc}; actor exits", file=sys.stderr)
            os._exit(1)

    def info(self) -> dict:
        return {"tier": self.tier, "index": self.index, "address": self.address, "pid": self.proc.pid,
                "alive": self.proc.poll() is None, "node_ip": self.node_ip, "log": str(self.log_path),
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    def wait_serving(self, timeout_s: float) -> bool:
        from specmesh.config import load_config
        from specmesh.health_probe import probe_tls_for, wait_serving

        config = self.workdir / "config.yaml"
        cfg = load_config(str(config) if config.exists() else None, environ=self.env)
        service = {"draft": "draft_worker", "target": "target_worker"}.get(self.tier, self.tier)
        return wait_serving(self.address, timeout_s, self.proc, tls=probe_tls_for(cfg, service))

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self, grace_s: float = 40.0) -> int | None:
        self._stopping = True
        stop_process(self.proc, grace_s)
        return self.proc.returncode


class MeshController:
    """Keeps the replicas of every tier; up / scale / status / down."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.replicas: dict[str, list] = {t: [] for t in START_ORDER}
        self._next = {t: 0 for t in START_ORDER}

    def _tier(self, tier: str) -> TierSpec:
        t = self.spec["tiers"][tier]
        return t if isinstance(t, TierSpec) else TierSpec(**t)

    def _spawn(self, tier: str, port: int = 0, extra_env: dict | None = None):
        t, i = self._tier(tier), self._next[tier]
        self._next[tier] += 1
        opts = dict(name=f"specmesh-{tier}-{i}", namespace=NAMESPACE, lifetime="detached", num_cpus=t.num_cpus,
                    max_restarts=-1, max_task_retries=0)
        if t.num_gpus:
            opts["num_gpus"] = t.num_gpus
        if t.resources:
            opts["resources"] = dict(t.resources)
        env = {k: str(v) for k, v in (self.spec.get("env") or {}).items()}
        if env:
            opts["runtime_env"] = {"env_vars": env}
        actor = RemoteServiceActor.options(**opts).remote(tier, i, self.spec, port, extra_env)
        self.replicas[tier].append(actor)
        return actor

    def _wait(self, actors: list) -> None:
        timeout = float(self.spec.get("start_timeout_s", 300.0))
        ok = ray.get([a.wait_serving.remote(timeout) for a in actors], timeout=timeout + 60)
        bad = [a for a, good in zip(actors, ok) if not good]
        if bad:
            tails = "\n".join(ray.get(a.log_tail.remote(), timeout=30) for a in bad)
            raise RuntimeError(f"{len(bad)} replica(s) did not become SERVING:\n{tails}")

    def up(self) -> list[dict]:
        started = [self._spawn(t) for t in ("target", "draft") for _ in range(self._tier(t).replicas)]
        started += [self._spawn("coordinator", self.spec["coordinator_port"] + i)
                    for i in range(self._tier("coordinator").replicas)]
        self._wait(started)
        coords = ray.get([a.info.remote() for a in self.replicas["coordinator"]])
        gateways = [self._spawn("gateway", self.spec["gateway_port"] if i == 0 else 0,
                                {"SPECMESH_GATEWAY__COORDINATOR": coords[i % len(coords)]["address"]})
                    for i in range(self._tier("gateway").replicas)]
        self._wait(gateways)
        return self.status()

    def scale(self, tier: str, replicas: int) -> list[dict]:
        if tier not in SCALABLE:
            raise ValueError(f"only {', '.join(SCALABLE)} scale at run time")
        current = self.replicas[tier]
        if replicas > len(current):
            self._wait([self._spawn(tier) for _ in range(replicas - len(current))])
        while len(current) > max(replicas, 0):
            self._remove(current.pop())
        return self.status()

    def _remove(self, actor) -> None:
        try:
            ray.get(actor.stop.remote(), timeout=90)  # SIGTERM: the worker drains (takes no new work)
        except Exception as exc:  # noqa: BLE001 - already dead
            log.warning("stop failed: %s", exc)
        ray.kill(actor, no_restart=True)

    def status(self) -> list[dict]:
        out = []
        for tier in START_ORDER:
            for i, actor in enumerate(self.replicas[tier]):
                try:
                    out.append(ray.get(actor.info.remote(), timeout=30))
                except Exception as exc:  # noqa: BLE001 - restarting or gone
                    out.append({"tier": tier, "index": i, "alive": False, "error": type(exc).__name__})
        return out

    def down(self) -> int:
        n = 0
        for tier in reversed(START_ORDER):  # gateways first: stop taking new work
            while self.replicas[tier]:
                self._remove(self.replicas[tier].pop())
                n += 1
        return n


RemoteServiceActor = ray.remote(ServiceActor)
RemoteMeshController = ray.remote(MeshController)


def controller():
    """The running mesh's controller actor, or None."""
    try:
        return ray.get_actor(CONTROLLER, namespace=NAMESPACE)
    except ValueError:
        return None


def up(spec: RayMeshSpec) -> list[dict]:
    if controller() is not None:
        raise RuntimeError("a specmesh mesh is already up on this Ray cluster (specmesh ray down first)")
    handle = RemoteMeshController.options(name=CONTROLLER, namespace=NAMESPACE, lifetime="detached",
                                               num_cpus=0, max_restarts=0).remote(asdict(spec))
    try:
        return ray.get(handle.up.remote(), timeout=spec.start_timeout_s + 120)
    except Exception:
        down()
        raise


def _call(method: str, *args, timeout: float = 600):
    handle = controller()
    if handle is None:
        raise RuntimeError("no specmesh mesh on this Ray cluster (specmesh ray up first)")
    return ray.get(getattr(handle, method).remote(*args), timeout=timeout)


def status() -> list[dict]:
    return _call("status", timeout=120)


def scale(tier: str, replicas: int) -> list[dict]:
    return _call("scale", tier, replicas)


def down() -> int:
    handle = controller()
    if handle is None:
        return 0
    try:
        return ray.get(handle.down.remote(), timeout=600)
    finally:
        ray.kill(handle, no_restart=True)
        time.sleep(0.5)
