"""Typed errors -> HTTP status, headers and OpenAI's error body. Pure.

{"error": {"message", "type", "param", "code"}}. The status follows the gRPC code the same
error gets on the gRPC front: INVALID_ARGUMENT 400, UNAUTHENTICATED 401, PERMISSION_DENIED 403,
NOT_FOUND 404, RESOURCE_EXHAUSTED 429 (Retry-After, and retry-after-ms as OpenAI sends it),
UNAVAILABLE 503, DEADLINE_EXCEEDED 504, a client that went away 499, anything else 500.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specmesh import errors
from specmesh.rpc.errors import typed

# gRPC code -> (HTTP status, OpenAI error type, OpenAI error code)
STATUS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error", None),
    "UNAUTHENTICATED": (401, "authentication_error", "invalid_api_key"),
    "PERMISSION_DENIED": (403, "permission_error", "permission_denied"),
    "NOT_FOUND": (404, "invalid_request_error", "not_found"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error", "rate_limit_exceeded"),
    "CANCELLED": (499, "invalid_request_error", "cancelled"),
    "UNAVAILABLE": (503, "server_error", "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout_error", "deadline_exceeded"),
    "FAILED_PRECONDITION": (500, "server_error", "failed_precondition"),
    "INTERNAL": (500, "server_error", "internal_error"),
}


class RequestTooLarge(errors.InvalidArgument):
    http_status = 413


@dataclass
class HttpError:
    status: int
    code: str  # the gRPC code name (what the access log and metrics record)
    body: dict
    headers: dict = field(default_factory=dict)

    @property
    def message(self) -> str:
        return self.body["error"]["message"]


def _retry_headers(exc: BaseException) -> dict:
    if not isinstance(exc, errors.ResourceExhausted):
        return {}
    if exc.retry_after_s is None:  # can never fit the key's tokens/minute: retrying cannot help
        return {"x-should-retry": "false"}
    wait = max(0.0, exc.retry_after_s)
    return {"retry-after": str(max(1, math.ceil(wait))), "retry-after-ms": str(max(1, math.ceil(wait * 1000)))}


def http_error(exc: BaseException, param_of=lambda f: f) -> HttpError:
    """exc: any exception (untyped ones are a 500). param_of: the core's field name -> OpenAI's."""
    exc = typed(exc)
    if not isinstance(exc, errors.SpecmeshError):
        exc_code, message, param = "INTERNAL", f"internal error: {type(exc).__name__}: {exc}", None
    else:
        exc_code, message, param = exc.code, str(exc), None
        if isinstance(exc, errors.InvalidArgument):
            param = param_of(exc.field)
            if param is not None and param != exc.field and message.startswith(exc.field + ":"):
                message = param + message[len(exc.field):]
    status, kind, code = STATUS.get(exc_code, STATUS["INTERNAL"])
    status = getattr(exc, "http_status", status)
    code = getattr(exc, "openai_code", code)
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return HttpError(status, exc_code, body, _retry_headers(exc))
