"""Per HTTP request what the gRPC server interceptor gives every RPC: a server span (parent from
the request's `traceparent` header), the request context (request id, key name, token counts)
that the coordinator call carries on, the RPC metrics and one access-log line.

The metrics and the log line use the same families, logger and fields as gRPC's, with
method = the route (e.g. /v1/chat/completions), status = the gRPC code name the same outcome
has there, plus http_status.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from specmesh.telemetry import context as reqctx
from specmesh.telemetry import metrics, tracing

log = logging.getLogger("specmesh.access")
SERVICE = "gateway"


class HttpCall:
    def __init__(self, http_method: str, route: str, headers, quiet: bool = False):
        self.route, self.quiet = route, quiet
        self.info = reqctx.RequestInfo(SERVICE, route)  # the public port trusts no x-specmesh-* header
        self.started = time.monotonic()
        parent = tracing.extract(headers)
        self.span = tracing.start_server_span(f"{http_method} {route}", parent, {
            "http.request.method": http_method, "url.path": route, "specmesh.service": SERVICE})
        self.otel_ctx = trace.set_span_in_context(self.span, parent)
        self._done = threading.Lock()
        self.finished = False
        metrics.INFLIGHT.labels(SERVICE).inc()

    def active(self):
        return reqctx.active_with_trace(self.otel_ctx, self.info)

    def context(self) -> contextvars.Context:
        """A copy of the current context with this request's span and info in force (for a thread)."""
        with self.active():
            return contextvars.copy_context()

    def finish(self, code: str, http_status: int, error: str | None = None) -> None:
        """Once per request (later calls are ignored): metrics, span status, the access-log line."""
        with self._done:
            if self.finished:
                return
            self.finished = True
        elapsed = time.monotonic() - self.started
        metrics.INFLIGHT.labels(SERVICE).dec()
        metrics.RPC_REQUESTS.labels(SERVICE, self.route, code).inc()
        metrics.RPC_DURATION.labels(SERVICE, self.route).observe(elapsed)
        with self.active():
            self._log(code, http_status, elapsed, error)
        self.span.set_attribute("http.response.status_code", http_status)
        if self.info.request_id:
            self.span.set_attribute("specmesh.request_id", self.info.request_id)
        if self.info.key_name:
            self.span.set_attribute("specmesh.api_key.name", self.info.key_name)
        if code != "OK":
            self.span.set_status(Status(StatusCode.ERROR, code))
        self.span.end()

    def _log(self, code: str, http_status: int, elapsed: float, error: str | None) -> None:
        level = logging.DEBUG if self.quiet and code == "OK" else logging.INFO
        if not log.isEnabledFor(level):
            return
        fields = {"event": "http", "rpc": f"http{self.route}", "status": code, "http_status": http_status,
                  "duration_ms": round(elapsed * 1000, 2)}
        if error:
            fields["error"] = error[:500]
        fields.update(self.info.fields)
        log.log(level, "%s %s %s", self.route, code, fields["duration_ms"], extra={"fields": fields})
