"""The mesh the suite runs against: `specmesh up`'s launcher on free loopback ports (the HTTP front
on too), a real redis-server (API keys: auth required), mTLS between the services, metrics on
OS-chosen ports, spans printed to the service logs (OTEL_TRACES_EXPORTER=console) so the no-text
check reads them. Every process it starts is stopped by stop(), by pid."""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml

from specmesh.config import MeshConfig, load_config
from specmesh.netutil import free_ports
from specmesh.reliability.pki import SuitePki, make_suite_pki

SERVICES = ("gateway", "coordinator", "draft_worker", "target_worker")
INTERNAL = ("coordinator", "draft_worker", "target_worker")
KEY_PREFIX = "chaos"
METRICS_URL = re.compile(r"metrics on (http://[^/\s\"]{1,80}/metrics)")

# small public limits: each is reached with few, cheap requests (the defaults are in docs/configuration.md)
SUITE_GATEWAY = {"max_tokens_limit": 64, "max_stop_strings": 8, "max_stop_chars": 64, "max_messages": 16,
                 "max_request_id_chars": 64, "max_prompt_bytes": 65536, "max_prompt_tokens": 512,
                 "max_message_bytes": 262144, "max_streams_per_connection": 4, "max_streams_per_key": 6}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def suite_config(redis_url: str, pki: SuitePki | None, overrides: dict | None = None) -> dict:
    """The suite's YAML data: four free loopback ports, auth on, mTLS when pki is given."""
    gw, co, dw, tw, http = (f"127.0.0.1:{p}" for p in free_ports(5))
    data = {
        "model": {"dtype": "float32"},
        "runtime": {"torch_threads": 1, "log_level": "INFO"},
        "speculative": {"method": "ngram", "num_speculative_tokens": 4},
        "gateway": {"listen": gw, "coordinator": co, **SUITE_GATEWAY},
        "coordinator": {"listen": co, "draft_workers": [dw], "target_workers": [tw], "local_ngram": False,
                        "draft_timeout_s": 10.0, "draft_retry_after_s": 1.0},
        "draft_worker": {"listen": dw, "methods": ["ngram", "draft_model", "block"], "cache_max_sequences": 64},
        "target_worker": {"listen": tw, "cache": {"max_tokens": 16384, "max_sequences": 48}},
        "auth": {"required": True, "redis_url": redis_url, "key_prefix": KEY_PREFIX},
        "metrics": {"host": "127.0.0.1", "gateway_port": -1, "coordinator_port": -1, "draft_worker_port": -1,
                    "target_worker_port": -1},
        "health": {"probe_interval_s": 30.0},
        "shutdown": {"grace_s": 3.0},
        "http": {"listen": http},  # the OpenAI-compatible front too: its socket is in the bind check
    }
    if pki is not None:
        data["tls"] = {"mesh": {"cert_file": str(pki.cert), "key_file": str(pki.key), "ca_file": str(pki.ca)}}
    return _merge(data, overrides or {})


def child_env() -> dict:
    """os.environ without SPECMESH_* settings (the suite's config file alone decides), spans to the logs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_") or k == "SPECMESH_HOME"}
    env.update(PYTHONUNBUFFERED="1", OTEL_TRACES_EXPORTER="console", GRPC_VERBOSITY="ERROR")
    return env


@dataclass
class SuiteMesh:
    workdir: Path
    data: dict
    cfg: MeshConfig
    pki: SuitePki | None
    keys: dict = field(default_factory=dict)  # name -> API key ("user", "other", "admin")
    launcher: object = None  # specmesh.launcher.Mesh
    redis: object = None  # specmesh.registry.local_redis.LocalRedis
    _tmp: object = None
    _draft_metrics: str | None = None  # the draft worker's /metrics URL, from its log

    def address(self, service: str) -> str:
        return self.data[service]["listen"]

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    def credentials(self) -> grpc.ChannelCredentials | None:
        if self.pki is None:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self.pki.ca.read_bytes(),
                                            private_key=self.pki.key.read_bytes(),
                                            certificate_chain=self.pki.cert.read_bytes())

    def channel(self, service: str, own_connection: bool = False) -> grpc.Channel:
        """A channel a trusted peer would open (the public port: plaintext; the mesh ports: mTLS).
        own_connection: never share the TCP connection with another channel."""
        return self.channel_to(self.address(service), own_connection, public=service == "gateway")

    def channel_to(self, address: str, own_connection: bool = False, public: bool = True) -> grpc.Channel:
        from specmesh.rpc.server import CHANNEL_OPTIONS

        options = list(CHANNEL_OPTIONS) + ([("grpc.use_local_subchannel_pool", 1)] if own_connection else [])
        creds = None if public else self.credentials()
        return grpc.secure_channel(address, creds, options) if creds else grpc.insecure_channel(address, options)

    def metadata(self, key: str = "user") -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.keys[key]}")]

    def add_key(self, name: str) -> str:
        """A new (non-admin) API key in the suite's Redis, used by name: metadata(name)."""
        from specmesh.auth.store import KeyStore, connect

        self.keys[name] = KeyStore(connect(self.redis.url), KEY_PREFIX).create(name)[0]
        return name

    def pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.launcher.children} if self.launcher else {}

    def draft_cache(self) -> tuple[int, int]:
        """(sequences, KV slots) the draft worker's drafters keep, from its /metrics (OSError: unreadable)."""
        if self._draft_metrics is None:
            found = METRICS_URL.search((self.log_dir / "draft_worker.log").read_text(errors="replace"))
            if found is None:
                raise OSError("the draft worker's log announces no /metrics")
            self._draft_metrics = found.group(1)
        with urllib.request.urlopen(self._draft_metrics, timeout=10) as r:
            return draft_cache_from_metrics(r.read().decode())

    def dead(self) -> list[str]:
        """Children that exited (any exit is a failure while the suite runs)."""
        return [f"{c.name} (exit {c.proc.returncode})" for c in self.launcher.children if c.proc.poll() is not None]

    def logs(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob("*.log")))

    def stop(self) -> None:
        if self.launcher is not None:
            self.launcher.stop(grace_s=15.0)
            for child in self.launcher.children:  # the launcher waited; make sure by pid
                if child.proc.poll() is None:
                    os.kill(child.proc.pid, signal.SIGKILL)
                    child.proc.wait()
        if self.redis is not None:
            self.redis.stop()
        if self._tmp is not None:
            self._tmp.cleanup()


def draft_cache_from_metrics(text: str) -> tuple[int, int]:
    """(sequences, KV slots) summed over the drafters, from a /metrics page."""
    total = {"sequences": 0.0, "tokens": 0.0}
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        if name.startswith("specmesh_draft_cache_") and name[len("specmesh_draft_cache_"):] in total:
            total[name[len("specmesh_draft_cache_"):]] += float(rest.rsplit(" ", 1)[1])
    return int(total["sequences"]), int(total["tokens"])


def start_suite_mesh(workdir: Path | None = None, tls: bool = True, overrides: dict | None = None,
                     start_timeout_s: float = 300.0, scale=None, registry: bool = False) -> SuiteMesh:
    """Redis, keys, certificates, config, then the four services; stopped by .stop().
    scale: replicas per tier (launcher.Scale). registry: workers register in the suite's Redis, which
    then persists (AOF) so that it can be restarted without losing keys or records."""
    from specmesh.auth.store import KeyStore, connect
    from specmesh.launcher import Mesh
    from specmesh.registry.local_redis import LocalRedis

    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="specmesh-chaos-")
        workdir = Path(tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    redis = LocalRedis(data_dir=workdir if registry else None).start()
    suite = SuiteMesh(workdir, {}, None, None, redis=redis, _tmp=tmp)
    try:
        suite.pki = make_suite_pki(workdir / "pki") if tls else None
        suite.data = suite_config(redis.url, suite.pki, overrides)
        path = workdir / "mesh.yaml"
        path.write_text(yaml.safe_dump(suite.data))
        suite.cfg = load_config(path, environ={})
        store = KeyStore(connect(redis.url), KEY_PREFIX)
        for name, admin in (("user", False), ("other", False), ("admin", True)):
            suite.keys[name] = store.create(name, admin=admin)[0]
        (workdir / "keys.json").write_text(json.dumps(suite.keys))  # throw-away keys of a throw-away Redis
        suite.launcher = Mesh(suite.cfg, str(path), str(suite.log_dir), env=child_env(), scale=scale,
                              redis_url=redis.url if registry else None)
        suite.launcher.start(timeout_s=start_timeout_s)
    except BaseException:
        suite.stop()
        raise
    return suite
