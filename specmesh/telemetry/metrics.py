"""Prometheus metrics of every service (names documented in README, "Metrics").

All families live in the default registry of the process; `service` labels tell the tiers
apart when several run in one process (tests). serve() starts /metrics on a port.
"""

from __future__ import annotations

import logging

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_ACCEPT = tuple(float(i) for i in range(1, 18))
_K = tuple(float(i) for i in range(0, 17))

# ---- every service (the server interceptor)
RPC_REQUESTS = Counter("specmesh_rpc_requests", "RPCs handled, by final status code",
                       ["service", "method", "code"])
RPC_DURATION = Histogram("specmesh_rpc_duration_seconds", "RPC handling time", ["service", "method"],
                         buckets=_LATENCY)
INFLIGHT = Gauge("specmesh_inflight_requests", "requests being handled now", ["service"])
QUEUE_LENGTH = Gauge("specmesh_queue_length", "requests waiting for an admission slot", ["service"])
OVERLOAD_REJECTIONS = Counter("specmesh_overload_rejections", "requests refused by backpressure (UNAVAILABLE)",
                              ["service"])
BATCH_QUEUE = Gauge("specmesh_batch_queue_length", "jobs queued for the model thread", ["service"])

# ---- gateway
AUTH_FAILURES = Counter("specmesh_auth_failures", "requests refused UNAUTHENTICATED / PERMISSION_DENIED",
                        ["reason"])
RATELIMIT_REJECTIONS = Counter("specmesh_ratelimit_rejections", "requests refused RESOURCE_EXHAUSTED",
                               ["limit"])
RATELIMIT_BACKEND_ERRORS = Counter("specmesh_ratelimit_backend_errors",
                                   "Redis unreachable during auth / rate limiting", ["mode"])
HEALTH_PROBE_OK = Gauge("specmesh_health_probe_ok", "1 while the gateway's one-token probe succeeds")

# ---- coordinator (speculation); `arm`: the canary arm of the request, spec | control
_TPOT = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.075, 0.1,
         0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5)
_E2E = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 5, 7.5, 10, 15, 20, 30, 60, 120, 300, 600)
DRAFTED = Counter("specmesh_drafted_tokens", "tokens proposed by the draft tier", ["method", "arm"])
ACCEPTED = Counter("specmesh_accepted_tokens", "drafted tokens the target accepted", ["method", "arm"])
DRAFTED_AT = Counter("specmesh_drafted_per_position", "rounds that drafted position i", ["method", "position", "arm"])
ACCEPTED_AT = Counter("specmesh_accepted_per_position", "rounds that accepted the draft at position i",
                      ["method", "position", "arm"])
ACCEPTANCE_LENGTH = Histogram("specmesh_acceptance_length", "tokens emitted per target verify round",
                              ["method", "arm"], buckets=_ACCEPT)
DRAFT_FAILURES = Counter("specmesh_draft_failures", "rounds run with the target alone because drafting failed",
                         ["arm"])
TIER_DOWN_ROUNDS = Counter("specmesh_draft_tier_down_rounds", "rounds run with the target alone, unasked, while no "
                           "draft worker could be asked (all down after a failure)", ["arm"])
DRAFT_LATENCY = Histogram("specmesh_draft_latency_seconds", "one Propose call, as the coordinator sees it",
                          ["method", "arm"], buckets=_LATENCY)
VERIFY_LATENCY = Histogram("specmesh_verify_latency_seconds", "one Verify call, as the coordinator sees it",
                           ["arm"], buckets=_LATENCY)
TTFT = Histogram("specmesh_ttft_seconds", "time to first token", ["arm"], buckets=_LATENCY)
TPOT = Histogram("specmesh_tpot_seconds", "time per output token after the first", ["arm"], buckets=_TPOT)
E2E = Histogram("specmesh_e2e_seconds", "a generation from receipt to its last token (finished OK)", ["arm"],
                buckets=_E2E)
REQUESTS = Counter("specmesh_requests", "generations by canary arm and final status code", ["arm", "code"])
PROMPT_TOKENS = Counter("specmesh_prompt_tokens", "prompt tokens of finished requests", ["arm"])
COMPLETION_TOKENS = Counter("specmesh_completion_tokens", "tokens generated", ["arm"])
SPEC_ENABLED = Gauge("specmesh_speculation_enabled", "1 while speculation is on (admin hot switch)")
SPEC_K = Gauge("specmesh_speculation_num_speculative_tokens", "k override (-1: the request's own)")
SPEC_METHOD = Gauge("specmesh_speculation_method", "1 for the drafter override in force ('' = the request's)",
                    ["method"])
SPEC_SWITCHES = Counter("specmesh_speculation_switches", "admin changes of the speculation settings")
CANARY_SHARE = Gauge("specmesh_canary_share", "share of eligible new requests in the spec arm (1 = all)")
CANARY_GUARD_TRIPS = Counter("specmesh_canary_guard_trips", "times the canary guard turned the share to 0")

# ---- target worker
LIVE_SEQUENCES = Gauge("specmesh_live_sequences", "sequences holding a KV cache")
KV_BYTES = Gauge("specmesh_kv_cache_bytes", "bytes held by all KV caches")
KV_TOKENS = Gauge("specmesh_kv_cache_tokens", "tokens held by all KV caches")
KV_USAGE = Gauge("specmesh_kv_cache_usage_ratio", "KV pool slots owned by live sequences / pool slots")
KV_RESERVED = Gauge("specmesh_kv_cache_reserved_tokens", "KV pool slots owned by live sequences (held + headroom)")
KV_POOL_BYTES = Gauge("specmesh_kv_cache_pool_bytes", "bytes of the KV pool allocated at start")
KV_RELOCATIONS = Gauge("specmesh_kv_cache_relocations", "sequences moved to a larger pool range (outgrew their reservation)")
DRAFT_TRIMMED = Gauge("specmesh_target_trimmed_draft_tokens",
                      "chain drafts left unverified beside other sequences (target_worker.draft_trim), since start")

# ---- draft worker
DRAFT_CACHE_SEQUENCES = Gauge("specmesh_draft_cache_sequences", "sequences whose drafter state is kept", ["method"])
DRAFT_CACHE_TOKENS = Gauge("specmesh_draft_cache_tokens", "KV slots the kept draft state holds", ["method"])


# ---- coordinator: the k each round chose
CHOSEN_K = Histogram("specmesh_chosen_k", "k chosen for a round (0: the target alone), observed per request "
                     "at its end", ["method", "arm"], buckets=_K)


def observe_chosen_k(method: str, chosen_k: dict[int, int], arm: str = "spec") -> None:
    """A finished request's rounds: {k: rounds that chose k}."""
    hist = CHOSEN_K.labels(method, arm)
    for k, rounds in chosen_k.items():
        for _ in range(rounds):
            hist.observe(k)


def serve(host: str, port: int, service: str) -> int | None:
    """Start /metrics: port 0 = off (None), -1 = any free port. Returns the port, or None if off or
    the port cannot be bound (logged: metrics are never worth refusing to serve)."""
    if port == 0:
        return None
    try:
        httpd, _ = start_http_server(max(port, 0), addr=host, registry=REGISTRY)
    except OSError as exc:
        log.error("%s: cannot serve metrics on %s:%s: %s", service, host, port, exc)
        return None
    bound = httpd.server_address[1]
    log.info("%s: metrics on http://%s:%d/metrics", service, host, bound)
    return bound


def observe_round(method: str, drafted: int, accepted: int, emitted: int, verify_s: float,
                  arm: str = "spec") -> None:
    ACCEPTANCE_LENGTH.labels(method, arm).observe(emitted)
    VERIFY_LATENCY.labels(arm).observe(verify_s)
    if drafted:
        DRAFTED.labels(method, arm).inc(drafted)
        ACCEPTED.labels(method, arm).inc(accepted)
        for i in range(drafted):
            DRAFTED_AT.labels(method, str(i), arm).inc()
        for i in range(accepted):
            ACCEPTED_AT.labels(method, str(i), arm).inc()
