"""Coordinator telemetry for one request: GenAI + specmesh.* span attributes, speculation
metrics (per round and per request, labelled with the request's canary arm), and the fields of
the request's access-log line."""

from __future__ import annotations

import logging
import time

from specmesh.core.canary import SPEC
from specmesh.errors import SpecmeshError
from specmesh.telemetry import context as reqctx
from specmesh.telemetry import genai, metrics, tracing

log = logging.getLogger(__name__)


def model_name(cfg) -> str:
    return cfg.model.path.rstrip("/").rsplit("/", 1)[-1] if cfg.model.path else cfg.model.name


def status_of(exc: BaseException | None) -> str:
    """The gRPC status code name a generation ends with (the interceptor maps errors the same way)."""
    if exc is None:
        return "OK"
    if isinstance(exc, GeneratorExit):  # a stream whose client went away
        return "CANCELLED"
    return exc.code if isinstance(exc, SpecmeshError) else "UNKNOWN"


class RequestTelemetry:
    def __init__(self, gen, model: str, raw: bool = False, control=None, arm: str = SPEC):
        self.gen, self.control, self.arm = gen, control, arm
        self.started = time.monotonic()
        info = reqctx.current()
        if info is not None and not info.request_id:
            info.request_id = gen.req.request_id
        tracing.set_attributes({**genai.request_attributes(model, gen.req, raw), genai.ARM: arm})

    def finish(self, exc: BaseException | None = None) -> None:
        gen, stats, arm = self.gen, self.gen.stats, self.arm
        prompt, completion = len(gen.req.prompt_ids), len(gen.out.token_ids)
        elapsed = time.monotonic() - self.started
        info = reqctx.current()
        if info is not None and info.probe:  # the gateway's health probe: no metrics, no attributes
            return
        code = status_of(exc)
        metrics.REQUESTS.labels(arm, code).inc()
        if code == "OK":
            metrics.E2E.labels(arm).observe(elapsed)
        if gen.ttft_s is not None:
            metrics.TTFT.labels(arm).observe(gen.ttft_s)
            if completion > 1:
                metrics.TPOT.labels(arm).observe(max(0.0, elapsed - gen.ttft_s) / (completion - 1))
        metrics.PROMPT_TOKENS.labels(arm).inc(prompt)
        metrics.COMPLETION_TOKENS.labels(arm).inc(completion)
        if stats.draft_failures:
            metrics.DRAFT_FAILURES.labels(arm).inc(stats.draft_failures)
        if stats.tier_down_rounds:
            metrics.TIER_DOWN_ROUNDS.labels(arm).inc(stats.tier_down_rounds)
        enabled = None if self.control is None else self.control.state.enabled
        metrics.observe_chosen_k(gen.method, stats.chosen_k, arm)
        tracing.set_attributes({
            **genai.response_attributes(prompt, completion, gen.out.finish_reason, gen.req.request_id),
            **genai.spec_attributes(gen.method, stats.rounds, stats.drafted_tokens, stats.accepted_tokens,
                                    stats.mean_acceptance_length, stats.draft_failures, enabled, gen.k, arm)})
        if info is not None:
            info.update(arm=arm, prompt_tokens=prompt, completion_tokens=completion,
                        finish_reason=gen.out.finish_reason,
                        ttft_ms=None if gen.ttft_s is None else round(gen.ttft_s * 1000, 2),
                        drafter=gen.method, rounds=stats.rounds, drafted_tokens=stats.drafted_tokens,
                        accepted_tokens=stats.accepted_tokens,
                        acceptance_length=round(stats.mean_acceptance_length, 3))


def on_round(method: str, drafted: int, accepted: int, emitted: int, draft_s: float, verify_s: float,
             arm: str = SPEC) -> None:
    """Generation's per-round observer (the coordinator binds the request's arm)."""
    metrics.observe_round(method, drafted, accepted, emitted, verify_s, arm)
    if method != "off" and draft_s > 0:
        metrics.DRAFT_LATENCY.labels(method, arm).observe(draft_s)


def speculation_changed(state) -> None:
    """SpeculationControl's on_change: gauges, a counter, a span attribute and one log line."""
    metrics.SPEC_ENABLED.set(1 if state.enabled else 0)
    metrics.SPEC_K.set(-1 if state.k is None else state.k)
    metrics.SPEC_METHOD.clear()
    metrics.SPEC_METHOD.labels(state.method or "").set(1)
    metrics.CANARY_SHARE.set(state.canary.share)
    if state.version > 0:
        metrics.SPEC_SWITCHES.inc()
    tracing.set_attributes({"specmesh.speculation.enabled": state.enabled,
                            "specmesh.speculation.method": state.method or "",
                            "specmesh.speculation.num_speculative_tokens": -1 if state.k is None else state.k,
                            "specmesh.speculation.version": state.version,
                            "specmesh.canary.share": state.canary.share})
    c = state.canary
    log.info("speculation: enabled=%s method=%s k=%s canary share=%s keys=%s (version %d)", state.enabled,
             state.method or "(request's)", "(request's)" if state.k is None else state.k, c.share,
             ",".join(c.keys) or "(all)", state.version,
             extra={"fields": {"event": "speculation_switch", "enabled": state.enabled, "method": state.method,
                               "k": state.k, "version": state.version, "canary_share": c.share,
                               "canary_keys": list(c.keys)}})
