"""Every environment variable the code reads, besides the generic config overrides.

Config overrides: SPECMESH_<SECTION>__<KEY>[__<KEY>] for any field of specmesh.config.MeshConfig
(e.g. SPECMESH_REGISTRY__URL, SPECMESH_GATEWAY__COORDINATOR, SPECMESH_SPECULATIVE__METHOD);
`is_config_override` tells whether a name is one. Deployment files (compose/, docs) may only use
names from ENV_VARS or valid config overrides — tests/unit/test_compose.py checks it.
"""

from __future__ import annotations

ENV_VARS = {
    # specmesh itself
    "SPECMESH_CONFIG": "the YAML config file (specmesh.config.load_config)",
    "SPECMESH_HOME": "model cache root (specmesh.engine.fetch), default ~/.cache/specmesh",
    "SPECMESH_PROBE_CACHE": "start-up probe results' folder, or off (specmesh.engine.probecache), default $SPECMESH_HOME/probes",
    "SPECMESH_REDIS_URL": "Redis for API keys / rate limits when auth.redis_url is null (specmesh.auth.store)",
    "SPECMESH_AUTH": "'required' forces API keys on (specmesh.config_ops)",
    "SPECMESH_API_KEY": "the key `specmesh generate` sends (specmesh.auth.cli)",
    # OpenTelemetry (specmesh.telemetry.tracing; the rest read by the OpenTelemetry SDK)
    "OTEL_TRACES_EXPORTER": "console | otlp | none",
    "OTEL_SDK_DISABLED": "true: no tracing SDK",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "collector address, e.g. http://otel-collector:4317",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "collector address for traces only",
    "OTEL_EXPORTER_OTLP_INSECURE": "true: plaintext gRPC to the collector",
    "OTEL_RESOURCE_ATTRIBUTES": "extra resource attributes (k=v,...)",
    "OTEL_TRACES_SAMPLER": "sampler name",
    "OTEL_SERVICE_NAME": "service.name (specmesh sets specmesh-<service> itself)",
    # W3C trace context handed to `specmesh ray` actors (specmesh.ray.env)
    "TRACEPARENT": "W3C traceparent of the launching driver",
    "TRACESTATE": "W3C tracestate of the launching driver",
    # Ray (specmesh.ray)
    "RAY_ADDRESS": "the Ray cluster `specmesh ray` connects to",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "set to 0 by `specmesh ray` for a local cluster: Ray stays on 127.0.0.1",
    "CUDA_VISIBLE_DEVICES": "GPUs Ray assigned to an actor, passed to its service process",
}


def is_config_override(name: str) -> bool:
    """True when SPECMESH_<SECTION>__<KEY>... names a real MeshConfig field."""
    import dataclasses
    import typing

    from specmesh.config import ENV_PREFIX, MeshConfig

    if not name.startswith(ENV_PREFIX) or "__" not in name:
        return False
    cls = MeshConfig
    for part in name[len(ENV_PREFIX):].lower().split("__"):
        if not dataclasses.is_dataclass(cls):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return False
        cls = hints[part]
    return True


def known(name: str) -> bool:
    return name in ENV_VARS or is_config_override(name)
