"""Decode and validate a public GenerateRequest into the loop's GenerationRequest.

The gateway runs this to answer INVALID_ARGUMENT naming the field before anything is queued;
the coordinator runs it again on what it receives (it trusts no caller)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from specmesh.config import MAX_TREE_BUDGET, METHODS, SpeculativeConfig
from specmesh.core.types import GenerationRequest, SamplingParams
from specmesh.errors import InvalidArgument
from specmesh.rpc.convert import sampling_from_pb
from specmesh.tokenization import PromptEncoder


@dataclass(frozen=True)
class Limits:
    """Sizes a request may have (gateway.* in the config; docs/reliability.md)."""

    max_tokens: int
    max_stop_strings: int
    max_stop_chars: int = 128
    max_messages: int = 128
    max_request_id_chars: int = 128
    max_prompt_bytes: int = 262144
    max_prompt_tokens: int = 0  # 0: the model's context window

    @classmethod
    def from_config(cls, gw) -> "Limits":
        """gw: specmesh.config.GatewayConfig (the coordinator checks the same limits)."""
        return cls(gw.max_tokens_limit, gw.max_stop_strings, gw.max_stop_chars, gw.max_messages,
                   gw.max_request_id_chars, gw.max_prompt_bytes, gw.max_prompt_tokens)


def _sampling(req) -> SamplingParams:
    s = req.sampling
    if s.HasField("temperature") and not math.isfinite(s.temperature):
        raise InvalidArgument("sampling.temperature", "must be a finite number >= 0")
    params = sampling_from_pb(s)
    try:
        params.validate()
    except InvalidArgument as exc:  # name the field as the client sent it
        raise InvalidArgument(f"sampling.{exc.field}", str(exc).split(": ", 1)[1]) from None
    return params


def _speculation(req, spec: SpeculativeConfig) -> tuple[str, int]:
    method = req.speculation.method or spec.method
    if method not in METHODS:
        raise InvalidArgument("speculation.method", f"unknown method {method!r} (known: {', '.join(METHODS)})")
    k = req.speculation.num_speculative_tokens if req.speculation.HasField("num_speculative_tokens") \
        else spec.num_speculative_tokens
    if not 0 <= k <= spec.max_speculative_tokens:
        raise InvalidArgument("speculation.num_speculative_tokens", f"must be in [0, {spec.max_speculative_tokens}]")
    if method == "off" or k == 0:
        return "off", 0
    return method, k


def _tree_budget(req, spec: SpeculativeConfig) -> int:
    """Draft-tree nodes per round: the request's (0 = chain), else the deployment's default."""
    if not req.speculation.HasField("tree_budget"):
        return spec.default_tree_budget()
    budget = req.speculation.tree_budget
    if not 0 <= budget <= MAX_TREE_BUDGET:
        raise InvalidArgument("speculation.tree_budget", f"must be in [0, {MAX_TREE_BUDGET}] (0 = chain)")
    return budget


def _stop(req, limits: Limits) -> tuple[str, ...]:
    if len(req.stop) > limits.max_stop_strings:
        raise InvalidArgument("stop", f"at most {limits.max_stop_strings} stop strings")
    if any(not s for s in req.stop):
        raise InvalidArgument("stop", "stop strings must not be empty")
    if any(len(s) > limits.max_stop_chars for s in req.stop):
        raise InvalidArgument("stop", f"a stop string may hold at most {limits.max_stop_chars} characters")
    return tuple(req.stop)


def valid_request_id(rid: str, limits: Limits) -> bool:
    """Forwarded as gRPC metadata and logged: printable ASCII, no spaces, bounded."""
    return len(rid) <= limits.max_request_id_chars and all("!" <= ch <= "~" for ch in rid)


def _request_id(req, limits: Limits) -> None:
    if not valid_request_id(req.request_id, limits):
        raise InvalidArgument("request_id", f"at most {limits.max_request_id_chars} printable ASCII characters, "
                                            "no spaces")


def _prompt_ids(req, encoder: PromptEncoder, limits: Limits) -> list[int]:
    which = req.WhichOneof("input")
    if which == "messages":
        field = "messages"
        if not req.messages.messages:
            raise InvalidArgument("messages", "must hold at least one message")
        if len(req.messages.messages) > limits.max_messages:
            raise InvalidArgument("messages", f"at most {limits.max_messages} messages")
        size = sum(len(m.content.encode()) for m in req.messages.messages)
    else:
        field = "prompt"
        if which != "prompt" or not req.prompt:
            raise InvalidArgument("prompt", "must not be empty (send prompt or messages)")
        size = len(req.prompt.encode())
    if size > limits.max_prompt_bytes:  # before tokenizing: a huge text costs seconds of CPU
        raise InvalidArgument(field, f"{size} bytes of text; at most {limits.max_prompt_bytes}")
    if field == "messages":
        ids = encoder.encode(None, [(m.role, m.content) for m in req.messages.messages])
    else:
        ids = encoder.encode(req.prompt, None, raw=req.raw)
    if limits.max_prompt_tokens and len(ids) > limits.max_prompt_tokens:
        raise InvalidArgument(field, f"{len(ids)} prompt tokens; at most {limits.max_prompt_tokens}")
    return ids


def decode_request(req, encoder: PromptEncoder, limits: Limits, spec: SpeculativeConfig,
                   timeout_s: float | None) -> GenerationRequest:
    if req.max_tokens < 1 or req.max_tokens > limits.max_tokens:
        raise InvalidArgument("max_tokens", f"must be in [1, {limits.max_tokens}]")
    params = _sampling(req)
    method, k = _speculation(req, spec)
    tree_budget = _tree_budget(req, spec)
    stop = _stop(req, limits)
    _request_id(req, limits)
    prompt_ids = _prompt_ids(req, encoder, limits)
    if len(prompt_ids) + req.max_tokens > encoder.context_window:
        raise InvalidArgument("max_tokens", f"prompt ({len(prompt_ids)} tokens) + max_tokens ({req.max_tokens}) "
                                            f"exceeds the {encoder.context_window}-token context window")
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    kwargs = {"request_id": req.request_id} if req.request_id else {}
    goodput = (spec.k_policy == "goodput" and method != "off"
               and not req.speculation.HasField("num_speculative_tokens"))  # an explicit k is fixed
    return GenerationRequest(prompt_ids, req.max_tokens, params, method, k, stop, deadline, tree_budget=tree_budget,
                             k_max=min(spec.goodput_k_max, spec.max_speculative_tokens) if goodput else 0, **kwargs)
