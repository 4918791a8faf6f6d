"""Config sections of the production gateway and observability (auth, rate limits, backpressure,
health, shutdown, metrics, TLS, logging, the speculation canary). Part of specmesh.config (MeshConfig holds them);
split out only to keep that module small. Same rules: frozen dataclasses, validated at load."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


from specmesh.config_load import _check  # noqa: F401  (the sections below validate with it)


def auth_env_override(environ) -> dict:
    """SPECMESH_AUTH=required|disabled (the documented shorthand) -> {"auth": {"required": ...}}."""
    value = str(environ.get("SPECMESH_AUTH", "")).strip().lower()
    if value in ("required", "on", "true", "1"):
        return {"auth": {"required": True}}
    if value in ("disabled", "off", "false", "0", "none"):
        return {"auth": {"required": False}}
    if value:
        _check(False, "SPECMESH_AUTH", f"{value!r} is not required|disabled")
    return {}


@dataclass(frozen=True)
class AuthConfig:
    required: bool = False  # API keys on the public port (env SPECMESH_AUTH=required|disabled wins)
    redis_url: str | None = None  # null: $SPECMESH_REDIS_URL, else redis://127.0.0.1:6379/0
    key_prefix: str = "specmesh"  # Redis key namespace for keys and rate-limit buckets
    redis_timeout_s: float = 0.5  # connect/read timeout; slower counts as unreachable

    def validate(self, key: str) -> None:
        _check(bool(self.key_prefix), f"{key}.key_prefix", "must not be empty")
        _check(self.redis_timeout_s > 0, f"{key}.redis_timeout_s", "must be > 0")


@dataclass(frozen=True)
class RateLimitConfig:
    enabled: bool = True  # per-key requests/minute and tokens/minute (set per key at creation)
    on_redis_error: str = "open"  # open: admit (counted, logged once per interval) | closed: UNAVAILABLE
    error_log_interval_s: float = 60.0

    def validate(self, key: str) -> None:
        _check(self.on_redis_error in ("open", "closed"), f"{key}.on_redis_error", "open|closed")
        _check(self.error_log_interval_s > 0, f"{key}.error_log_interval_s", "must be > 0")


@dataclass(frozen=True)
class AdmissionConfig:
    max_inflight: int = 64  # requests handled at once
    max_queue: int = 64  # requests waiting for a slot; beyond: UNAVAILABLE at once
    queue_timeout_s: float = 10.0  # a request waits at most this long for a slot (and never past its deadline)

    def validate(self, key: str) -> None:
        _check(self.max_inflight >= 1, f"{key}.max_inflight", "must be >= 1")
        _check(self.max_queue >= 0, f"{key}.max_queue", "must be >= 0")
        _check(self.queue_timeout_s >= 0, f"{key}.queue_timeout_s", "must be >= 0")


@dataclass(frozen=True)
class BackpressureConfig:
    gateway: AdmissionConfig = field(default_factory=AdmissionConfig)
    coordinator: AdmissionConfig = field(default_factory=AdmissionConfig)
    draft_worker: AdmissionConfig = field(default_factory=AdmissionConfig)
    target_worker: AdmissionConfig = field(default_factory=AdmissionConfig)

    def validate(self, key: str) -> None:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(f"{key}.{f.name}")


@dataclass(frozen=True)
class CanaryConfig:
    """coordinator.canary: the speculation canary at start (docs/rollout.md)."""

    share: float = 1.0  # share of new requests in the `spec` arm; the rest run with speculation off
    keys: tuple[str, ...] = ()  # limit the canary to these API key names (others: control); () = all
    guard_margin: float | None = None  # trip (share -> 0) when spec's TPOT p99 > control's x (1 + margin)
    guard_min_requests: int = 20  # TPOT samples each arm needs in a window before the guard judges
    guard_interval_s: float = 10.0  # the guard looks this often

    def validate(self, key: str) -> None:
        _check(0.0 <= self.share <= 1.0, f"{key}.share", "must be in [0, 1]")
        _check(all(bool(k) and "," not in k for k in self.keys), f"{key}.keys", "non-empty names without ','")
        _check(self.guard_margin is None or self.guard_margin >= 0, f"{key}.guard_margin", "must be >= 0 or null")
        _check(self.guard_min_requests >= 1, f"{key}.guard_min_requests", "must be >= 1")
        _check(self.guard_interval_s > 0, f"{key}.guard_interval_s", "must be > 0")


@dataclass(frozen=True)
class HealthConfig:
    probe_interval_s: float = 10.0  # gateway: a one-token generation through the mesh this often
    probe_timeout_s: float = 30.0
    startup_retry_s: float = 1.0  # until the first probe succeeds, retry this often

    def validate(self, key: str) -> None:
        _check(self.probe_interval_s > 0, f"{key}.probe_interval_s", "must be > 0")
        _check(self.probe_timeout_s > 0, f"{key}.probe_timeout_s", "must be > 0")
        _check(self.startup_retry_s > 0, f"{key}.startup_retry_s", "must be > 0")


@dataclass(frozen=True)
class ShutdownConfig:
    grace_s: float = 20.0  # on SIGTERM: refuse new work, let in-flight requests finish this long

    def validate(self, key: str) -> None:
        _check(self.grace_s >= 0, f"{key}.grace_s", "must be >= 0")


@dataclass(frozen=True)
class MetricsConfig:
    host: str = "127.0.0.1"  # Prometheus /metrics listen address
    gateway_port: int = 0  # 0 = off, -1 = any free port (logged at start)
    coordinator_port: int = 0
    draft_worker_port: int = 0
    target_worker_port: int = 0

    def validate(self, key: str) -> None:
        for f in dataclasses.fields(self):
            if f.name.endswith("_port"):
                _check(-1 <= getattr(self, f.name) < 65536, f"{key}.{f.name}", "must be -1, 0 or a port")


@dataclass(frozen=True)
class PublicTlsConfig:
    cert_file: str | None = None  # PEM; with key_file: the public port speaks TLS
    key_file: str | None = None
    client_ca_file: str | None = None  # also require client certificates signed by this CA
    ca_file: str | None = None  # the CA that signed cert_file, for our own probes (default: cert_file)
    server_name: str | None = None  # the name our probes expect in cert_file (default: the address)

    def validate(self, key: str) -> None:
        _check((self.cert_file is None) == (self.key_file is None), key, "needs both cert_file and key_file")
        _check(self.ca_file is None or self.cert_file is not None, f"{key}.ca_file", "needs cert_file and key_file")
        _check(self.client_ca_file is None or self.cert_file is not None, f"{key}.client_ca_file",
               "needs cert_file and key_file")


@dataclass(frozen=True)
class MeshTlsConfig:
    cert_file: str | None = None  # PEM; with key_file and ca_file: mTLS between services
    key_file: str | None = None
    ca_file: str | None = None  # the CA every service certificate is signed by
    server_name: str | None = None  # override the name checked in server certificates

    def validate(self, key: str) -> None:
        files = (self.cert_file, self.key_file, self.ca_file)
        _check(all(f is None for f in files) or all(f is not None for f in files), key,
               "needs all of cert_file, key_file and ca_file (or none)")


@dataclass(frozen=True)
class TlsConfig:
    public: PublicTlsConfig = field(default_factory=PublicTlsConfig)
    mesh: MeshTlsConfig = field(default_factory=MeshTlsConfig)

    def validate(self, key: str) -> None:
        self.public.validate(f"{key}.public")
        self.mesh.validate(f"{key}.mesh")


@dataclass(frozen=True)
class HttpConfig:
    """The OpenAI-compatible HTTP front on the gateway (gateway/http): its own port, same core."""

    listen: str | None = None  # host:port; null = off
    default_max_tokens: int = 256  # a request without max_tokens / max_completion_tokens gets this
    max_request_bytes: int = 4 * 1024 * 1024  # a bigger JSON body is refused (413)

    def validate(self, key: str) -> None:
        if self.listen is not None:
            host, sep, port = self.listen.rpartition(":")
            _check(bool(sep) and bool(host) and port.isdigit() and 0 < int(port) < 65536, f"{key}.listen",
                   f"{self.listen!r} is not host:port (or null: off)")
        _check(self.default_max_tokens >= 1, f"{key}.default_max_tokens", "must be >= 1")
        _check(self.max_request_bytes >= 1024, f"{key}.max_request_bytes", "must be >= 1024")


@dataclass(frozen=True)
class LoggingConfig:
    format: str = "json"  # json (one object per line) | text
    log_text: bool = False  # DEBUG ONLY: put prompt and completion text into request log lines

    def validate(self, key: str) -> None:
        _check(self.format in ("json", "text"), f"{key}.format", "json|text")
