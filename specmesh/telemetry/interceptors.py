"""gRPC interceptors: one server span per RPC (context from metadata), request context, metrics
and one access-log line per RPC; the client side forwards trace context and request facts.

Error mapping stays in specmesh.rpc.errors (wrap_unary / wrap_stream run inside these spans, so
the status the client sees is the one recorded). Health checks are neither traced nor logged.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import grpc
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from specmesh.rpc.errors import guard_decoding, map_errors, wrap_stream, wrap_unary
from specmesh.telemetry import context as reqctx
from specmesh.telemetry import metrics, tracing

log = logging.getLogger("specmesh.access")

HEALTH_PREFIX = "/grpc.health.v1."
# one INFO line per request for these; per-round internals (Verify, Propose, ...) log at DEBUG
REQUEST_METHODS = frozenset({"Generate", "GenerateStream", "Prefill", "GetSpeculation", "SetSpeculation",
                             "GetCanary"})
_QUIET_CODES = ("OK", "CANCELLED", "INVALID_ARGUMENT", "NOT_FOUND")


def _code(context, exc: BaseException | None) -> str:
    code = context.code()
    if code is not None:
        return code.name
    if isinstance(exc, GeneratorExit) or (exc is None and not context.is_active()):
        return "CANCELLED"
    return "OK" if exc is None else "UNKNOWN"


class _Rpc:
    """Everything one server-side RPC carries: request info, span, timing."""

    def __init__(self, service: str, public: bool, full_method: str, context, counter=None):
        self.counter = counter
        metadata = context.invocation_metadata()
        method = full_method.rsplit("/", 1)[-1]
        self.full_method, self.method, self.service = full_method, method, service
        # the public port trusts no x-specmesh-* header from clients
        self.info = reqctx.RequestInfo(service, method) if public else \
            reqctx.from_metadata(service, method, metadata)
        self.started = time.monotonic()
        parent = tracing.extract(metadata)
        self.span = None
        if not self.info.probe:
            rpc_service = full_method.strip("/").rsplit("/", 1)[0]
            self.span = tracing.start_server_span(full_method.strip("/"), parent, {
                "rpc.system": "grpc", "rpc.service": rpc_service, "rpc.method": method,
                "specmesh.service": service})
            parent = trace.set_span_in_context(self.span, parent)
        self.otel_ctx = parent
        metrics.INFLIGHT.labels(service).inc()
        if counter is not None:
            counter.add(1)

    def active(self):
        return reqctx.active_with_trace(self.otel_ctx, self.info)

    def finish(self, context, exc: BaseException | None) -> None:
        code = _code(context, exc)
        elapsed = time.monotonic() - self.started
        metrics.INFLIGHT.labels(self.service).dec()
        if self.counter is not None:
            self.counter.add(-1)
        metrics.RPC_REQUESTS.labels(self.service, self.method, code).inc()
        metrics.RPC_DURATION.labels(self.service, self.method).observe(elapsed)
        with self.active():
            self._log(code, elapsed, context)
        if self.span is not None:
            self.span.set_attributes({"rpc.grpc.status_code": getattr(grpc.StatusCode, code).value[0]})
            if self.info.request_id:
                self.span.set_attribute("specmesh.request_id", self.info.request_id)
            if self.info.key_name:
                self.span.set_attribute("specmesh.api_key.name", self.info.key_name)
            if self.info.arm:
                self.span.set_attribute("specmesh.canary.arm", self.info.arm)
            if code not in ("OK",):
                self.span.set_status(Status(StatusCode.ERROR, code))
            self.span.end()

    def _log(self, code: str, elapsed: float, context) -> None:
        level = logging.INFO if self.method in REQUEST_METHODS else logging.DEBUG
        if code not in _QUIET_CODES:
            level = max(level, logging.INFO)
        if self.info.probe:
            level = logging.DEBUG
        if not log.isEnabledFor(level):
            return
        fields = {"event": "rpc", "rpc": self.full_method.strip("/"), "status": code,
                  "duration_ms": round(elapsed * 1000, 2)}
        if code != "OK":
            details = context.details() or ""
            fields["error"] = (details.decode("utf-8", "replace") if isinstance(details, bytes) else str(details))[:500]
        if self.info.arm:
            fields["arm"] = self.info.arm
        fields.update(self.info.fields)
        log.log(level, "%s %s %s", self.full_method.strip("/"), code, fields["duration_ms"], extra={"fields": fields})


class _Counter:
    def __init__(self):
        self.value = 0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


class ServerInterceptor(grpc.ServerInterceptor):
    """Telemetry around the typed-error mapping, for every unary and server-streaming handler.

    refusing(): True while the server shuts down; new RPCs then get UNAVAILABLE (retryable
    elsewhere) while the ones in flight (`inflight`) finish."""

    def __init__(self, service: str, public: bool = False, refusing=lambda: False):
        self.service = service
        self.public = public
        self.refusing = refusing
        self._inflight = _Counter()

    @property
    def inflight(self) -> int:
        return self._inflight.value

    def _refuse_if_stopping(self, context) -> None:
        if self.refusing():
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.service} is shutting down; retry elsewhere")

    def intercept_service(self, continuation, handler_call_details):
        handler = guard_decoding(continuation(handler_call_details))  # garbage in: INVALID_ARGUMENT
        if handler is None:
            return None
        method = handler_call_details.method
        if method.startswith(HEALTH_PREFIX):
            return map_errors(handler)
        if handler.unary_unary:
            return handler._replace(unary_unary=self._unary(method, wrap_unary(handler.unary_unary)))
        if handler.unary_stream:
            return handler._replace(unary_stream=self._stream(method, wrap_stream(handler.unary_stream)))
        return handler

    def _unary(self, method: str, fn):
        def handler(request, context):
            self._refuse_if_stopping(context)
            rpc = _Rpc(self.service, self.public, method, context, self._inflight)
            exc_seen = None
            try:
                with rpc.active():
                    return fn(request, context)
            except BaseException as exc:
                exc_seen = exc
                raise
            finally:
                rpc.finish(context, exc_seen)

        return handler

    def _stream(self, method: str, fn):
        def handler(request, context):
            self._refuse_if_stopping(context)
            rpc = _Rpc(self.service, self.public, method, context, self._inflight)
            it, exc_seen = None, None
            try:
                while True:
                    with rpc.active():
                        if it is None:
                            it = fn(request, context)
                        try:
                            item = next(it)
                        except StopIteration:
                            return
                    yield item
            except BaseException as exc:  # GeneratorExit: the client went away
                exc_seen = exc
                raise
            finally:
                if it is not None:
                    with rpc.active():
                        it.close()  # runs the handler's own clean-up (release the sequence) now
                rpc.finish(context, exc_seen)

        return handler


_Details = collections.namedtuple("_Details", ("method", "timeout", "metadata", "credentials",
                                               "wait_for_ready", "compression"))


class ClientInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the current trace context and request facts to every outgoing call's metadata."""

    def _details(self, d):
        metadata = list(d.metadata or ())
        have = {k for k, _ in metadata}
        info = reqctx.current()
        extra = reqctx.outgoing_metadata(info)
        if info is None or not info.probe:
            extra += tracing.inject()
        metadata += [(k, v) for k, v in extra if k not in have]
        return _Details(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready,
                        getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)
