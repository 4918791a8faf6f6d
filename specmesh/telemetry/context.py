"""The request-scoped facts every hop logs and propagates (request id, API key name, probe, and
the speculation canary's arm once the coordinator has chosen it).

A RequestInfo lives for one RPC; the server interceptor creates it and makes it current while
the handler runs; servicers add fields (token counts, status facts) for the access log line;
the client interceptor forwards request id / key name / probe to the next hop as metadata.
Never holds the API key itself, and text only when the debug flag put it there.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

# gRPC metadata keys carried between the services (lower-case, as gRPC requires)
REQUEST_ID_KEY = "x-specmesh-request-id"
KEY_NAME_KEY = "x-specmesh-key-name"
PROBE_KEY = "x-specmesh-probe"  # the gateway's health probe: not traced, logged at DEBUG
ARM_KEY = "x-specmesh-arm"  # the canary arm (spec | control), from the coordinator to the workers
AUTHORIZATION_KEY = "authorization"


@dataclass
class RequestInfo:
    service: str
    method: str
    request_id: str = ""
    key_name: str = ""
    probe: bool = False
    arm: str = ""
    fields: dict = field(default_factory=dict)  # extra access-log fields (token counts, timings, ...)

    def update(self, **values) -> None:
        self.fields.update({k: v for k, v in values.items() if v is not None})


_current: contextvars.ContextVar[RequestInfo | None] = contextvars.ContextVar("specmesh_request", default=None)


def current() -> RequestInfo | None:
    return _current.get()


@contextmanager
def active(info: RequestInfo | None) -> Iterator[RequestInfo | None]:
    token = _current.set(info)
    try:
        yield info
    finally:
        _current.reset(token)


def outgoing_metadata(info: RequestInfo | None) -> list[tuple[str, str]]:
    """Metadata a call made while serving `info` carries to the next hop."""
    if info is None:
        return []
    out = []
    if info.request_id:
        out.append((REQUEST_ID_KEY, info.request_id))
    if info.key_name:
        out.append((KEY_NAME_KEY, info.key_name))
    if info.probe:
        out.append((PROBE_KEY, "1"))
    if info.arm:
        out.append((ARM_KEY, info.arm))
    return out


def from_metadata(service: str, method: str, metadata) -> RequestInfo:
    md = {k: v for k, v in (metadata or ())}
    return RequestInfo(service, method, request_id=str(md.get(REQUEST_ID_KEY, "")),
                       key_name=str(md.get(KEY_NAME_KEY, "")), probe=PROBE_KEY in md, arm=str(md.get(ARM_KEY, "")))


@contextmanager
def active_with_trace(otel_ctx, info: RequestInfo | None) -> Iterator[None]:
    """A request's trace context (OpenTelemetry) and its info in force together: what a servicer
    runs under, whichever front (gRPC interceptor, HTTP) received the request."""
    from opentelemetry import context as otel_context

    token = otel_context.attach(otel_ctx)
    try:
        with active(info):
            yield
    finally:
        otel_context.detach(token)
