"""A throw-away redis-server on a free loopback port (tests, `specmesh up --redis local`).

Nothing is persisted (no RDB, no AOF), unless data_dir is given: then every write is appended to
an AOF there (fsync always), so a stop and start on the same port keeps the keys (the reliability
suite's Redis restart). Needs the `redis-server` binary (Debian: redis-server).
"""

from __future__ import annotations

import shutil
import subprocess
import time

import redis

from specmesh.netutil import free_port  # also imported from here by specmesh.ray
from specmesh.procutil import stop_process


class LocalRedis:
    def __init__(self, port: int | None = None, host: str = "127.0.0.1", data_dir=None):
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server not found on PATH (apt-get install redis-server)")
        self.host, self.port = host, port or free_port(host)
        self.proc: subprocess.Popen | None = None
        self.data_dir = data_dir

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> "LocalRedis":
        persist = ["--appendonly", "no"] if self.data_dir is None else \
            ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.data_dir)]
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", self.host, "--save", "", *persist,
             "--protected-mode", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        client = redis.Redis(host=self.host, port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode(errors='replace')}")
            try:
                if client.ping():
                    client.close()
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer on {self.host}:{self.port}")

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 5)

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
