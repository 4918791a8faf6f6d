"""Service-side telemetry helpers: admission limiters with their metrics, engine gauges read at
scrape time."""

from __future__ import annotations

from specmesh.rpc.admission import AdmissionLimiter
from specmesh.telemetry import metrics


def admission_limiter(role: str, admission_cfg) -> AdmissionLimiter:
    """The role's limiter (specmesh.config.AdmissionConfig), counting refusals and exposing its
    queue length and in-flight count as metrics."""
    limiter = AdmissionLimiter.from_config(role, admission_cfg,
                                           on_reject=metrics.OVERLOAD_REJECTIONS.labels(role).inc)
    metrics.QUEUE_LENGTH.labels(role).set_function(lambda: limiter.waiting)
    return limiter


def watch_target_engine(engine) -> None:
    """Live sequences, KV bytes / tokens / usage and the batch queue, computed on each scrape."""
    metrics.LIVE_SEQUENCES.set_function(engine.live_sequences)
    metrics.KV_BYTES.set_function(engine.kv_bytes)
    metrics.KV_TOKENS.set_function(engine.held_tokens)
    metrics.KV_USAGE.set_function(lambda: engine.reserved_tokens() / max(1, engine.pool.max_tokens))
    metrics.KV_RESERVED.set_function(engine.reserved_tokens)
    metrics.KV_POOL_BYTES.set_function(engine.pool.nbytes)
    metrics.KV_RELOCATIONS.set_function(lambda: engine.pool.relocations)
    metrics.DRAFT_TRIMMED.set_function(lambda: engine.trimmed_tokens)
    metrics.BATCH_QUEUE.labels("target_worker").set_function(engine.batcher.qsize)


def watch_batcher(role: str, batcher) -> None:
    metrics.BATCH_QUEUE.labels(role).set_function(batcher.qsize)


def watch_drafter_caches(drafters: dict) -> None:
    """Sequences and KV slots each model drafter keeps (its per-sequence LRU), on each scrape."""
    for name, drafter in drafters.items():
        if hasattr(drafter, "cached_sequences"):
            metrics.DRAFT_CACHE_SEQUENCES.labels(name).set_function(drafter.cached_sequences)
            metrics.DRAFT_CACHE_TOKENS.labels(name).set_function(drafter.cached_tokens)
