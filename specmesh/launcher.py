"""`specmesh up`: the four services as separate OS processes on loopback.

Start order follows the dependencies (target, draft, coordinator, gateway); each must report
SERVING on grpc.health.v1 before the next starts. Ctrl-C / SIGTERM stops them all (SIGTERM,
then SIGKILL after a grace period); if any one dies, the rest are stopped too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.config import MeshConfig

SERVICES = (  # (name, module, config attribute holding `listen`)
    ("target_worker", "target_worker.server", "target_worker"),
    ("draft_worker", "draft_worker.server", "draft_worker"),
    ("coordinator", "coordinator.server", "coordinator"),
    ("gateway", "gateway.server", "gateway"),
)


@dataclass
class Child:
    name: str
    address: str
    proc: subprocess.Popen
    log_path: Path | None


def wait_serving(address: str, timeout_s: float, proc: subprocess.Popen | None = None) -> bool:
    """Poll grpc.health.v1 until SERVING; False on timeout or if proc exits first."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                return False
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    return False


class Mesh:
    def __init__(self, cfg: MeshConfig, config_path: str | None, log_dir: str | None, env: dict | None = None):
        self.cfg, self.config_path = cfg, config_path
        self.log_dir = Path(log_dir) if log_dir else None
        self.env = dict(os.environ if env is None else env)
        self.children: list[Child] = []

    def _spawn(self, name: str, module: str, address: str) -> Child:
        cmd = [sys.executable, "-m", module]
        if self.config_path:
            cmd += ["--config", str(self.config_path)]
        log_path, out = None, None
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = self.log_dir / f"{name}.log"
            out = open(log_path, "ab")
        proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT if out else None,
                                start_new_session=True)
        return Child(name, address, proc, log_path)

    def start(self, timeout_s: float = 300.0) -> None:
        for name, module, section in SERVICES:
            address = getattr(self.cfg, section).listen
            child = self._spawn(name, module, address)
            self.children.append(child)
            if not wait_serving(address, timeout_s, child.proc):
                where = f" (see {child.log_path})" if child.log_path else ""
                self.stop()
                raise RuntimeError(f"{name} did not become SERVING on {address}{where}")
            print(f"specmesh: {name} serving on {address} (pid {child.proc.pid})", file=sys.stderr)

    def dead(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self, grace_s: float = 15.0) -> None:
        for child in reversed(self.children):  # gateway first: stop taking new work
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()

    def run_until_signal(self) -> int:
        got: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: got.append(s))
        while not got:
            dead = self.dead()
            if dead:
                print(f"specmesh: {dead.name} exited with {dead.proc.returncode}; stopping the mesh", file=sys.stderr)
                self.stop()
                return 1
            time.sleep(0.5)
        print("specmesh: stopping", file=sys.stderr)
        self.stop()
        return 0
