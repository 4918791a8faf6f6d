"""Span attributes: OpenTelemetry GenAI semantic conventions plus specmesh.* speculation facts.

Pure dict builders (no SDK), so servicers stay thin and the names are unit-tested in one place.
"""

from __future__ import annotations

OPERATION = "gen_ai.operation.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_SEED = "gen_ai.request.seed"
USAGE_INPUT = "gen_ai.usage.input_tokens"
USAGE_OUTPUT = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
RESPONSE_ID = "gen_ai.response.id"
ARM = "specmesh.canary.arm"  # spec | control: the request's arm of the speculation canary


def request_attributes(model: str, req, raw: bool = False) -> dict:
    """req: a core GenerationRequest (validated)."""
    p = req.params
    return {
        OPERATION: "text_completion" if raw else "chat",
        REQUEST_MODEL: model,
        REQUEST_MAX_TOKENS: req.max_tokens,
        REQUEST_TEMPERATURE: float(p.temperature),
        REQUEST_TOP_P: float(p.top_p),
        REQUEST_TOP_K: int(p.top_k),
        REQUEST_SEED: p.seed,
        "specmesh.request_id": req.request_id,
        "specmesh.request.method": req.method,
        "specmesh.request.num_speculative_tokens": req.k,
    }


def response_attributes(prompt_tokens: int, completion_tokens: int, finish_reason: str | None,
                        request_id: str | None = None) -> dict:
    out = {USAGE_INPUT: int(prompt_tokens), USAGE_OUTPUT: int(completion_tokens), RESPONSE_ID: request_id}
    if finish_reason:
        out[FINISH_REASONS] = [finish_reason]
    return out


def spec_attributes(method: str, rounds: int, drafted: int, accepted: int, acceptance_length: float,
                    draft_failures: int = 0, enabled: bool | None = None, k: int | None = None,
                    arm: str | None = None) -> dict:
    return {
        "specmesh.drafter": method,
        "specmesh.rounds": int(rounds),
        "specmesh.drafted_tokens": int(drafted),
        "specmesh.accepted_tokens": int(accepted),
        "specmesh.acceptance_length": float(acceptance_length),
        "specmesh.draft_failures": int(draft_failures),
        "specmesh.speculation.enabled": enabled,
        "specmesh.speculation.num_speculative_tokens": k,
        ARM: arm or None,
    }


def spec_attributes_from_pb(spec) -> dict:
    """From a protobuf SpecStats (what the gateway sees in the final response/chunk)."""
    return spec_attributes(spec.method, spec.rounds, spec.drafted_tokens, spec.accepted_tokens,
                           spec.mean_acceptance_length, spec.draft_failures, arm=spec.arm)
