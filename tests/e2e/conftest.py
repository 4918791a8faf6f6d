"""Fixtures for the e2e tier: the mesh as real OS processes started by `specmesh up`.

Nothing here is in-process: every service is its own Python process talking gRPC over TCP.
Test modules get the helper functions through the `e2e` fixture (tests/ has no packages, so a
conftest cannot be imported by name).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from specmesh.netutil import free_ports  # noqa: F401 - also used by tests as conftest.free_ports
from specmesh.procutil import stop_process

REPO = Path(__file__).resolve().parents[2]
SPECMESH = [sys.executable, "-m", "specmesh.cli"]
SERVICES = ("target_worker", "draft_worker", "coordinator", "gateway")
START_TIMEOUT_S = 300.0  # four processes loading torch + the model on a slow shared box
PID_LINE = re.compile(r"specmesh: (\w+) serving on (\S+) \(pid (\d+)\)")


PROBE_CACHE = Path(tempfile.mkdtemp(prefix="specmesh-e2e-probes-"))


def pytest_runtest_setup(item):
    """This tier's mesh processes share one probe cache of their own (probecache.py): a worker's
    second start on the same model skips its start-up probes, as a user's does. Set before the
    test's fixtures start anything; the suite's other tiers probe every time (tests/conftest.py)."""
    os.environ["SPECMESH_PROBE_CACHE"] = str(PROBE_CACHE)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        os.environ["SPECMESH_PROBE_CACHE"] = "off"


def pytest_sessionfinish(session):
    shutil.rmtree(PROBE_CACHE, ignore_errors=True)


def model_cached() -> bool:
    from specmesh.engine.fetch import model_cache_dir

    return (model_cache_dir() / "model.safetensors").is_file()


def port_open(address: str, timeout: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie still answers kill(0); it has exited for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def clean_env(**extra) -> dict:
    """os.environ without SPECMESH_* settings (overrides, SPECMESH_CONFIG, SPECMESH_AUTH, ...) but
    SPECMESH_HOME (the model cache): the test's config file alone decides."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_") or k == "SPECMESH_HOME"}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def mesh_config(tmp: Path, **sections) -> tuple[Path, dict]:
    """A YAML config with four free ports on 127.0.0.1; `sections` are merged over it."""
    gw, co, dw, tw = (f"127.0.0.1:{p}" for p in free_ports(4))
    data = {
        "model": {"dtype": "float32"},  # CPU: fp32 is fast and makes batched/unbatched argmax agree
        "runtime": {"torch_threads": 1, "log_level": "INFO"},  # 2 shared cores, 4 processes
        "speculative": {"method": "ngram", "num_speculative_tokens": 4},
        "gateway": {"listen": gw, "coordinator": co, "max_tokens_limit": 64},
        # local_ngram false: n-gram stands in for a model drafter, so its rounds cross the draft tier
        # (killed, scaled, traced below); test_mesh's default-config test runs it in the coordinator
        "coordinator": {"listen": co, "draft_workers": [dw], "target_workers": [tw],
                        "draft_timeout_s": 10.0, "draft_retry_after_s": 1.0, "local_ngram": False},
        "draft_worker": {"listen": dw, "methods": ["ngram"]},  # no second model to load
        "target_worker": {"listen": tw},
    }
    for name, over in sections.items():
        data[name] = {**data.get(name, {}), **over}
    path = tmp / "mesh.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, data


def run_cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run(SPECMESH + list(args), capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=clean_env())


@dataclass
class UpMesh:
    """`specmesh up` running as a subprocess, with the pids it printed for its four children."""

    proc: subprocess.Popen
    config_path: Path
    config: dict
    log_dir: Path
    stderr_path: Path
    pids: dict = field(default_factory=dict)  # service -> pid

    def address(self, service: str) -> str:
        return self.config[service]["listen"]

    @property
    def gateway(self) -> str:
        return self.address("gateway")

    @property
    def http_url(self) -> str:
        """The gateway's OpenAI-compatible front (a mesh started with http.listen)."""
        return f"http://{self.config['http']['listen']}/v1"

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def logs(self) -> str:
        out = [f"--- specmesh up stderr\n{self.stderr()}"]
        for p in sorted(self.log_dir.glob("*.log")):
            out.append(f"--- {p.name}\n{p.read_text(errors='replace')[-4000:]}")
        return "\n".join(out)

    def read_pids(self) -> dict:
        for name, _addr, pid in PID_LINE.findall(self.stderr()):
            self.pids[name] = int(pid)
        return self.pids

    def wait_started(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specmesh up exited with {self.proc.returncode}\n{self.logs()}")
            if "mesh up" in self.stderr() and len(self.read_pids()) == 4:
                return
            time.sleep(0.5)
        raise RuntimeError(f"specmesh up not ready after {timeout:.0f}s\n{self.logs()}")

    def wait_healthy(self, timeout: float = 120.0) -> subprocess.CompletedProcess:
        """Poll `specmesh health --target <gateway>` until it exits 0."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = run_cli("health", "--target", self.gateway, "--timeout", "60")
            if last.returncode == 0:
                return last
            if self.proc.poll() is not None:
                break
            time.sleep(1.0)
        raise RuntimeError(f"specmesh health never passed: {last and (last.stdout + last.stderr)}\n{self.logs()}")

    def terminate(self, grace_s: float = 40.0) -> int | None:
        """SIGTERM `specmesh up`, wait, then make sure no child survives (kill stragglers we started)."""
        stop_process(self.proc, grace_s)
        for pid in self.read_pids().values():
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        return self.proc.returncode


def start_up_mesh(tmp: Path, **sections) -> UpMesh:
    config_path, config = mesh_config(tmp, **sections)
    log_dir = tmp / "logs"
    stderr_path = tmp / "up.stderr"
    with open(stderr_path, "wb") as err, open(tmp / "up.stdout", "wb") as out:
        proc = subprocess.Popen(
            SPECMESH + ["up", "--config", str(config_path), "--log-dir", str(log_dir),
                        "--start-timeout", str(START_TIMEOUT_S)],
            stdout=out, stderr=err, cwd=REPO, env=clean_env())
    return UpMesh(proc, config_path, config, log_dir, stderr_path)


@pytest.fixture(scope="module")
def up_mesh(tmp_path_factory):
    """`specmesh up` on free ports (HTTP front included), healthy (specmesh health exited 0). Stopped at
    module end."""
    if not model_cached():
        pytest.skip("default model not cached (run `specmesh fetch-model`)")
    # with the OpenAI-compatible HTTP front on a free port, as `http.listen` turns it on
    mesh = start_up_mesh(tmp_path_factory.mktemp("up_mesh"), http={"listen": f"127.0.0.1:{free_ports(1)[0]}"})
    try:
        mesh.wait_started()
        mesh.wait_healthy()
        yield mesh
    finally:
        mesh.terminate()


class E2E:
    """The helpers above, for test modules (see the module docstring)."""

    SERVICES = SERVICES
    REPO = REPO
    SPECMESH = SPECMESH
    UpMesh = UpMesh
    clean_env = staticmethod(clean_env)
    free_ports = staticmethod(free_ports)
    port_open = staticmethod(port_open)
    pid_alive = staticmethod(pid_alive)
    run_cli = staticmethod(run_cli)
    start_up_mesh = staticmethod(start_up_mesh)
    model_cached = staticmethod(model_cached)


@pytest.fixture(scope="session")
def e2e():
    return E2E
