"""OpenAI request JSON -> the public GenerateRequest. Pure: no I/O, no transport.

Only shape and type are checked here (with OpenAI's parameter names); ranges are the core's
(specmesh.rpc.requests), so both fronts refuse the same values with the same words. Defaults
are OpenAI's: temperature 1, top_p 1. Fields that would change the output and that the mesh
does not implement (n > 1, penalties, logprobs, tools, ...) are refused, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.errors import InvalidArgument, NotFound
from specmesh.v1 import specmesh_pb2 as pb

OPENAI_DEFAULT_TEMPERATURE = 1.0
# field -> the values that mean "not used" (anything else is refused: the mesh does not implement it)
_UNSUPPORTED = {
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
    "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none"), "function_call": (None, "none"), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "audio": (None,), "prediction": (None,),
}
_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role


class ModelNotFound(NotFound):
    openai_code = "model_not_found"


@dataclass(frozen=True)
class Parsed:
    request: pb.GenerateRequest
    chat: bool  # /v1/chat/completions (else /v1/completions)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    max_tokens_param: str  # the name the client used (errors about max_tokens name it)


def _typed(body: dict, key: str, types: tuple, what: str, prefix: str = ""):
    value = body.get(key)
    if value is not None and (not isinstance(value, types) or isinstance(value, bool) and bool not in types):
        raise InvalidArgument(prefix + key, f"must be {what}")
    return value


def _check_model(body: dict, served: str) -> None:
    model = _typed(body, "model", (str,), "a string")
    if model and model != served:
        raise ModelNotFound(f"model {model!r} is not served here; this mesh serves {served!r} (GET /v1/models)")


def _refuse_unsupported(body: dict) -> None:
    n = _typed(body, "n", (int,), "an integer")
    if n not in (None, 1):
        raise InvalidArgument("n", "only n=1 is supported (one choice per request)")
    for key, unused in _UNSUPPORTED.items():
        value = body.get(key)
        if not any(value == u and type(value) is type(u) for u in unused):
            raise InvalidArgument(key, "is not supported by this server (leave it unset)")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise InvalidArgument("response_format", "only {\"type\": \"text\"} is supported")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return list(stop)
    raise InvalidArgument("stop", "must be a string or a list of strings")


def _sampling(body: dict, req: pb.GenerateRequest) -> None:
    temperature = _typed(body, "temperature", (int, float), "a number")
    req.sampling.temperature = OPENAI_DEFAULT_TEMPERATURE if temperature is None else float(temperature)
    top_p = _typed(body, "top_p", (int, float), "a number")
    if top_p is not None:
        req.sampling.top_p = float(top_p)
    top_k = _typed(body, "top_k", (int,), "an integer")  # an extension (vLLM has it too)
    if top_k is not None:
        req.sampling.top_k = top_k
    seed = _typed(body, "seed", (int,), "an integer")
    if seed is not None:
        if not -(2 ** 63) <= seed < 2 ** 63:
            raise InvalidArgument("seed", "must fit in 64 bits")
        req.sampling.seed = seed


def _speculation(body: dict, req: pb.GenerateRequest) -> None:
    """The `speculation` extension object: {method, num_speculative_tokens, tree_budget}."""
    spec = body.get("speculation")
    if spec is None:
        return
    if not isinstance(spec, dict):
        raise InvalidArgument("speculation", "must be an object")
    method = _typed(spec, "method", (str,), "a string", "speculation.")
    if method:
        req.speculation.method = method
    for key in ("num_speculative_tokens", "tree_budget"):
        value = _typed(spec, key, (int,), "an integer", "speculation.")
        if value is not None:
            if not -(2 ** 31) <= value < 2 ** 31:
                raise InvalidArgument(f"speculation.{key}", "out of range")
            setattr(req.speculation, key, value)


def _max_tokens(body: dict, default: int) -> tuple[int, str]:
    for key in ("max_completion_tokens", "max_tokens"):  # the newer name wins
        value = _typed(body, key, (int,), "an integer")
        if value is not None:
            return max(0, min(value, 2 ** 31 - 1)), key
    return default, "max_tokens"


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = bool(_typed(body, "stream", (bool,), "true or false"))
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise InvalidArgument("stream_options", "is only allowed with stream: true")
    if not isinstance(opts, dict):
        raise InvalidArgument("stream_options", "must be an object")
    return stream, bool(_typed(opts, "include_usage", (bool,), "true or false", "stream_options."))


def _common(body, served: str, default_max_tokens: int) -> tuple[pb.GenerateRequest, str, bool, bool]:
    if not isinstance(body, dict):
        raise InvalidArgument("body", "must be a JSON object")
    _check_model(body, served)
    _refuse_unsupported(body)
    max_tokens, param = _max_tokens(body, default_max_tokens)
    req = pb.GenerateRequest(max_tokens=max_tokens, stop=_stop(body))
    _sampling(body, req)
    _speculation(body, req)
    stream, include_usage = _stream_flags(body)
    return req, param, stream, include_usage


def _content(i: int, content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidArgument(f"messages[{i}].content", "only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidArgument(f"messages[{i}].content", "must be a string or a list of text parts")


def decode_chat(body, served: str, default_max_tokens: int) -> Parsed:
    """POST /v1/chat/completions: the conversation goes through the model's chat template."""
    req, param, stream, include_usage = _common(body, served, default_max_tokens)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages", "must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidArgument(f"messages[{i}]", "must be an object with a string role")
        role = _ROLE_ALIASES.get(m["role"], m["role"])
        out.append(pb.ChatMessage(role=role, content=_content(i, m.get("content"))))
    req.messages.CopyFrom(pb.MessageList(messages=out))
    return Parsed(req, True, stream, include_usage, param)


def decode_completion(body, served: str, default_max_tokens: int) -> Parsed:
    """POST /v1/completions: the prompt is continued as is (raw, no chat template)."""
    req, param, stream, include_usage = _common(body, served, default_max_tokens)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise InvalidArgument("prompt", "one prompt per request (a single string); token-id prompts are "
                                        "not supported")
    if not isinstance(prompt, str) or not prompt:
        raise InvalidArgument("prompt", "must be a non-empty string")
    req.prompt, req.raw = prompt, True
    return Parsed(req, False, stream, include_usage, param)


def openai_param(field: str, parsed: Parsed | None) -> str | None:
    """The core's field name (sampling.temperature, max_tokens, ...) as the OpenAI client sent it."""
    if field == "request":  # a later hop refused the request as a whole
        return None
    if field.startswith("sampling."):
        return field.split(".", 1)[1]
    if field == "max_tokens" and parsed is not None:
        return parsed.max_tokens_param
    if field == "prompt" and parsed is not None and parsed.chat:
        return "messages"
    return field
