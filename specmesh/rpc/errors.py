"""One place where typed errors become gRPC status codes, and back.

Servers: ErrorInterceptor wraps every handler; a SpecmeshError aborts with its code and
message, anything else is logged and answered INTERNAL. Clients: raise_from_rpc turns a
grpc.RpcError into the matching SpecmeshError, so a status crosses hops unchanged.
"""

from __future__ import annotations

import logging

import grpc

from specmesh import errors

log = logging.getLogger(__name__)

_BY_CODE = {
    "INVALID_ARGUMENT": lambda m: errors.InvalidArgument("request", m),
    "UNAUTHENTICATED": errors.Unauthenticated,
    "PERMISSION_DENIED": errors.PermissionDenied,
    "RESOURCE_EXHAUSTED": errors.ResourceExhausted,
    "UNAVAILABLE": errors.Unavailable,
    "DEADLINE_EXCEEDED": errors.DeadlineExceeded,
    "NOT_FOUND": errors.NotFound,
    "FAILED_PRECONDITION": errors.FailedPrecondition,
    "CANCELLED": errors.Cancelled,
}


def status_code(exc: errors.SpecmeshError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, exc.code, grpc.StatusCode.INTERNAL)


def typed(exc: BaseException) -> BaseException:
    """Map the few untyped errors with an obvious status (a future's timeout) to typed ones."""
    if isinstance(exc, TimeoutError):  # concurrent.futures.TimeoutError: the caller's deadline ran out
        return errors.DeadlineExceeded(f"deadline exceeded: {exc}" if str(exc) else "deadline exceeded")
    return exc


def _abort(context: grpc.ServicerContext, exc: BaseException):
    exc = typed(exc)
    if isinstance(exc, errors.SpecmeshError):
        if isinstance(exc, errors.ResourceExhausted) and exc.retry_after_s is not None:
            context.set_trailing_metadata((("retry-after", f"{exc.retry_after_s:.3f}"),))
        context.abort(status_code(exc), str(exc))
    log.exception("unhandled error in handler")
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")


def _handle(context: grpc.ServicerContext, exc: Exception):
    """A handler raised exc: answer it with its status, but let context.abort's own exception through."""
    if not isinstance(exc, errors.SpecmeshError) and _is_abort(exc):
        raise exc
    _abort(context, exc)


class Undecodable:
    """Stands in for a request its method's message type cannot parse (invalid UTF-8 in a string,
    a corrupt wire format, nesting past the parser's limit): the handler answers INVALID_ARGUMENT,
    where gRPC itself would answer INTERNAL ("Exception deserializing request!")."""

    def __init__(self, error: BaseException):
        self.error = error


def _lenient(deserialize):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, RecursionError, ...
            return Undecodable(exc)

    return parse


def _refuse_undecodable(request) -> None:
    if isinstance(request, Undecodable):
        raise errors.InvalidArgument("request", f"not a valid message of this method's type "
                                                f"({type(request.error).__name__})")


def guard_decoding(handler):
    """handler (a grpc.RpcMethodHandler) raising InvalidArgument for an undecodable request; wrap
    it in the error mapping (map_errors, or wrap_unary / wrap_stream) to answer the status."""
    if handler is None or handler.request_deserializer is None or not (handler.unary_unary or handler.unary_stream):
        return handler  # client-streaming methods (reflection) keep gRPC's own decoding
    handler = handler._replace(request_deserializer=_lenient(handler.request_deserializer))
    if handler.unary_unary:
        inner_unary = handler.unary_unary

        def unary(request, context):
            _refuse_undecodable(request)
            return inner_unary(request, context)

        return handler._replace(unary_unary=unary)
    inner_stream = handler.unary_stream

    def stream(request, context):
        _refuse_undecodable(request)
        yield from inner_stream(request, context)

    return handler._replace(unary_stream=stream)


def _wrap_unary(fn):
    def handler(request, context):
        try:
            return fn(request, context)
        except Exception as exc:  # noqa: BLE001
            _handle(context, exc)

    return handler


def _wrap_stream(fn):
    def handler(request, context):
        try:
            yield from fn(request, context)
        except Exception as exc:  # noqa: BLE001
            _handle(context, exc)

    return handler


def _is_abort(exc: BaseException) -> bool:
    # context.abort raises a plain Exception subclass private to grpc; let it through
    return type(exc).__module__.startswith("grpc")


wrap_unary = _wrap_unary  # for interceptors that compose the mapping with their own wrapping
wrap_stream = _wrap_stream


def map_errors(handler):
    """handler with the typed-error mapping around its unary or server-streaming function."""
    if handler is None:
        return None
    if handler.unary_unary:
        return handler._replace(unary_unary=_wrap_unary(handler.unary_unary))
    if handler.unary_stream:
        return handler._replace(unary_stream=_wrap_stream(handler.unary_stream))
    return handler


class ErrorInterceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation, handler_call_details):
        return map_errors(guard_decoding(continuation(handler_call_details)))


def raise_from_rpc(err: grpc.RpcError, hop: str) -> None:
    """Re-raise a client-side RpcError as the typed error of the same status."""
    code = err.code().name if hasattr(err, "code") and err.code() else "UNKNOWN"
    message = f"{hop}: {err.details() if hasattr(err, 'details') else err}"
    make = _BY_CODE.get(code)
    if make is None:
        raise errors.SpecmeshError(message) from err
    raise make(message) from err
