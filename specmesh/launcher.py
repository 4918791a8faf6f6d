"""`specmesh up`: the services as separate OS processes on loopback, each tier scaled on its own.

Replicas: --target-workers M --draft-workers N --coordinators C --gateways G (default 1 each).
The first replica of a service listens on its configured address; extra replicas take the next
free ports after the highest configured port (or any free port with free_ports=True). Children
are named <service> for the first replica and <service>_<i> for the others (logs: <name>.log).

With `http.listen` set every gateway also serves the OpenAI-compatible HTTP front: the first on
http.listen, extra replicas on free ports (SPECMESH_HTTP__LISTEN); `up` prints their URLs.

Wiring: without a registry the launcher passes the static lists: every coordinator gets all the
worker addresses (SPECMESH_COORDINATOR__DRAFT_WORKERS / __TARGET_WORKERS). Every gateway talks to
every coordinator (round-robin; a dead one is skipped, a refused call retried on the next) when
their addresses are IPv4 literals, else gateway i to coordinator i mod C. With a registry (redis_url, or "local": a redis-server started and stopped
with the mesh) every child gets SPECMESH_REGISTRY__URL: workers register, coordinators watch.

Every child starts at once (nothing needs another at start: channels connect lazily); the mesh
is up when all report SERVING on grpc.health.v1 (and, with a registry, every worker is
registered). Ctrl-C / SIGTERM stops them all (SIGTERM, then SIGKILL after a grace period). A dead
draft worker or a dead extra replica is reported and the mesh keeps serving; when the last
gateway, coordinator or target worker is gone the rest are stopped too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specmesh.config import MeshConfig, literal_host
from specmesh.health_probe import check_serving, probe_tls_for, wait_serving
from specmesh.netutil import free_port
from specmesh.procutil import wait_or_kill
from specmesh.rpc.client_tls import ClientTls

__all__ = ["Mesh", "Scale", "Child", "plan_addresses", "port_free", "check_serving", "wait_serving", "SERVICES"]

SERVICES = (  # (name, module, config attribute holding `listen`) in dependency order
    ("target_worker", "target_worker.server", "target_worker"),
    ("draft_worker", "draft_worker.server", "draft_worker"),
    ("coordinator", "coordinator.server", "coordinator"),
    ("gateway", "gateway.server", "gateway"),
)
ESSENTIAL = ("target_worker", "coordinator", "gateway")  # the mesh is down when one of these has no process


@dataclass(frozen=True)
class Scale:
    target_workers: int = 1
    draft_workers: int = 1
    coordinators: int = 1
    gateways: int = 1

    def count(self, service: str) -> int:
        return {"target_worker": self.target_workers, "draft_worker": self.draft_workers,
                "coordinator": self.coordinators, "gateway": self.gateways}[service]


@dataclass
class Child:
    name: str
    address: str
    proc: subprocess.Popen
    log_path: Path | None
    service: str = ""
    probe: ClientTls = ClientTls()  # how the launcher's health probe reaches it (TLS per the config)


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def plan_addresses(cfg: MeshConfig, scale: Scale, free_ports: bool = False) -> dict[str, list[str]]:
    """service -> listen address per replica (see the module doc)."""
    taken = {int(getattr(cfg, sec).listen.rsplit(":", 1)[1]) for _, _, sec in SERVICES}
    next_port = max(taken) + 1
    out: dict[str, list[str]] = {}
    for name, _, section in SERVICES:
        first = getattr(cfg, section).listen
        host = first.rsplit(":", 1)[0]
        bind_host = "127.0.0.1" if host in ("localhost", "0.0.0.0", "") else host
        addrs = [first] if scale.count(name) >= 1 else []
        for _ in range(scale.count(name) - 1):
            if free_ports:  # below the ephemeral range: no outgoing connection takes it before the bind
                addrs.append(f"{host}:{free_port(bind_host)}")
                continue
            while next_port in taken or not port_free(bind_host, next_port):
                next_port += 1
            taken.add(next_port)
            addrs.append(f"{host}:{next_port}")
        out[name] = addrs
    return out


def plan_http(cfg: MeshConfig, gateways: int) -> list[str]:
    """The OpenAI-compatible HTTP front's address per gateway replica (none while http.listen is
    null): http.listen for the first, any free port on its host for each extra replica."""
    if not cfg.http.listen:
        return []
    host = cfg.http.listen.rpartition(":")[0]
    out = [cfg.http.listen][:gateways]
    for _ in range(gateways - 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1" if host in ("localhost", "0.0.0.0", "") else host, 0))
            out.append(f"{host}:{s.getsockname()[1]}")
    return out


class Mesh:
    def __init__(self, cfg: MeshConfig, config_path: str | None, log_dir: str | None, env: dict | None = None,
                 scale: Scale | None = None, redis_url: str | None = None, free_ports: bool = False):
        self.cfg, self.config_path = cfg, config_path
        self.log_dir = Path(log_dir) if log_dir else None
        self.env = dict(os.environ if env is None else env)
        self.scale = scale or Scale()
        self.redis_url = redis_url or cfg.registry.url
        self.free_ports = free_ports
        self.children: list[Child] = []
        self.addresses: dict[str, list[str]] = {}
        self.http: list[str] = []  # the gateways' OpenAI-compatible HTTP fronts (http.listen)
        self.local_redis = None
        self._reported: set[str] = set()

    @property
    def gateways(self) -> list[str]:
        return self.addresses.get("gateway", [])

    @property
    def http_urls(self) -> list[str]:
        scheme = "https" if self.cfg.tls.public.cert_file else "http"
        return [f"{scheme}://{a}/v1" for a in self.http]

    def _child_env(self, service: str, index: int, base: dict | None = None) -> dict:
        """The environment of `service` child `index`: base (default self.env) plus its wiring."""
        env = dict(self.env if base is None else base)
        if self.redis_url:
            env["SPECMESH_REGISTRY__URL"] = self.redis_url
        elif service == "coordinator":
            env["SPECMESH_COORDINATOR__DRAFT_WORKERS"] = "[" + ", ".join(self.addresses["draft_worker"]) + "]"
            env["SPECMESH_COORDINATOR__TARGET_WORKERS"] = "[" + ", ".join(self.addresses["target_worker"]) + "]"
        if service == "gateway":
            coords = self.addresses["coordinator"]
            every = all(literal_host(a) for a in coords)
            # every gateway over every coordinator (round-robin, a dead one skipped) where the
            # addresses allow it (IPv4 literals), else gateway i -> coordinator i mod C
            env["SPECMESH_GATEWAY__COORDINATOR"] = ",".join(coords) if every else coords[index % len(coords)]
            if self.http:
                env["SPECMESH_HTTP__LISTEN"] = self.http[index]
        return env

    def _spawn(self, name: str, module: str, address: str, service: str = "", index: int = 0,
               extra_env: dict | None = None) -> Child:
        cmd = [sys.executable, "-m", module, "--listen", address]
        if self.config_path:
            cmd += ["--config", str(self.config_path)]
        log_path, out = None, None
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{name}.log"
            out = open(log_path, "ab")
        base = {**self.env, **(extra_env or {})}
        env = self._child_env(service, index, base) if service else base
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                start_new_session=True)
        if out:
            out.close()
        return Child(name, address, proc, log_path, service, probe_tls_for(self.cfg, service or name))

    def start(self, timeout_s: float = 300.0) -> None:
        if self.redis_url == "local":
            from specmesh.registry.local_redis import LocalRedis

            self.local_redis = LocalRedis().start()
            self.redis_url = self.local_redis.url
            print(f"specmesh: registry redis-server at {self.redis_url}", file=sys.stderr)
        self.addresses = plan_addresses(self.cfg, self.scale, self.free_ports)
        self.http = plan_http(self.cfg, len(self.addresses["gateway"]))
        for service, module, _ in SERVICES:
            for i, address in enumerate(self.addresses[service]):
                name = service if i == 0 else f"{service}_{i}"
                self.children.append(self._spawn(name, module, address, service, i))
        try:
            self._wait_all(time.monotonic() + timeout_s)
        except RuntimeError:
            self.stop()
            raise

    def _wait_all(self, deadline: float) -> None:
        pending = list(self.children)
        while pending:
            for child in list(pending):
                if child.proc.poll() is not None or time.monotonic() > deadline:
                    where = f" (see {child.log_path})" if child.log_path else ""
                    raise RuntimeError(f"{child.name} did not become SERVING on {child.address}{where}")
                if check_serving(child.address, tls=child.probe):
                    pending.remove(child)
                    print(f"specmesh: {child.name} serving on {child.address} (pid {child.proc.pid})",
                          file=sys.stderr)
            time.sleep(0.2)
        if self.redis_url:
            self._wait_registered(deadline)

    def _wait_registered(self, deadline: float) -> None:
        from specmesh.registry.store import Registry, RegistryError

        reg = Registry(self.redis_url, self.cfg.registry.namespace, self.cfg.registry.ttl_s)
        want = {"target": set(self.addresses["target_worker"]), "draft": set(self.addresses["draft_worker"])}
        try:
            while time.monotonic() < deadline:
                try:
                    if all(want[t] <= {r.address for r in reg.list(t)} for t in want):
                        time.sleep(2 * self.cfg.registry.poll_interval_s)  # coordinators' next poll
                        return
                except RegistryError:
                    pass
                time.sleep(0.2)
        finally:
            reg.close()
        raise RuntimeError(f"workers did not all register in {self.redis_url}")

    def respawn(self, name: str, extra_env: dict | None = None) -> Child:
        """Start child `name` again, after it exited (what a supervisor's restart does): same module,
        address and wiring; extra_env on top (e.g. another model). Does not wait for it."""
        i, old = next((i, c) for i, c in enumerate(self.children) if c.name == name)
        if old.proc.poll() is None:
            raise RuntimeError(f"{name} is still running (pid {old.proc.pid})")
        module = next(m for s, m, _ in SERVICES if s == old.service)
        index = int(name.rsplit("_", 1)[1]) if name != old.service else 0
        self.children[i] = self._spawn(name, module, old.address, old.service, index, extra_env)
        self._reported.discard(name)
        return self.children[i]

    def dead(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def fatal(self) -> str | None:
        """Report newly exited children; the reason to stop when an essential tier is gone."""
        for c in self.children:
            if c.proc.poll() is not None and c.name not in self._reported:
                self._reported.add(c.name)
                print(f"specmesh: {c.name} exited with {c.proc.returncode}", file=sys.stderr)
        for service in ESSENTIAL:
            group = [c for c in self.children if (c.service or c.name) == service]
            if group and all(c.proc.poll() is not None for c in group):
                return f"no {service} left"
        return None

    def stop(self, grace_s: float | None = None) -> bool:
        """SIGTERM every child (gateways first), wait for them to drain; True when all exited 0 in time.
        A child still running after grace_s (default: the services' own shutdown.grace_s + 10 s for
        their last round and exit) is killed and reported."""
        grace_s = self.cfg.shutdown.grace_s + 10.0 if grace_s is None else grace_s
        for child in reversed(self.children):  # gateways first: stop taking new work
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        clean = True
        for child in self.children:
            if not wait_or_kill(child.proc, max(0.1, deadline - time.monotonic())):
                print(f"specmesh: {child.name} still running {grace_s:.0f}s after SIGTERM: killed",
                      file=sys.stderr)
                clean = False
                continue
            if child.proc.returncode != 0 and child.name not in self._reported:
                print(f"specmesh: {child.name} exited with {child.proc.returncode}", file=sys.stderr)
                clean = False
        if self.local_redis is not None:
            self.local_redis.stop()
        return clean

    def run_until_signal(self) -> int:
        got: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: got.append(s))
        while not got:
            reason = self.fatal()
            if reason:
                print(f"specmesh: {reason}; stopping the mesh", file=sys.stderr)
                self.stop()
                return 1
            time.sleep(0.5)
        print("specmesh: stopping (in-flight requests finish first)", file=sys.stderr)
        return 0 if self.stop() else 1
