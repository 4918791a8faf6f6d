"""The Starlette app: OpenAI JSON in -> the gateway core (on worker threads) -> OpenAI JSON out.

Routes: POST /v1/chat/completions, POST /v1/completions (both with stream: true as SSE ending
in `data: [DONE]`), GET /v1/models, GET /v1/models/{id}, GET /health. Every generation goes
through GatewayCore exactly as a gRPC call does: API key, validation, admission, rate limits,
deadline (header X-Request-Timeout, seconds; clamped to gateway.max_deadline_s), cancellation.
An error before the first token is an HTTP status; one during a stream is an SSE error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from gateway.http.bridge import ThreadStream, run_blocking
from gateway.http.encode import DONE, Encoder, model_json, models_json, sse
from gateway.http.errors import RequestTooLarge, http_error
from gateway.http.schema import ModelNotFound, Parsed, decode_chat, decode_completion, openai_param
from gateway.http.telemetry import HttpCall
from specmesh.auth.keys import bearer_token
from specmesh.errors import Cancelled, InvalidArgument, SpecmeshError, Unavailable

log = logging.getLogger(__name__)
TIMEOUT_HEADER = "x-request-timeout"


@dataclass
class FrontState:
    draining: bool = False  # shutting down: new requests get 503
    ready: Callable[[], bool] = field(default=lambda: True)  # GET /health (the gateway's mesh probe)


class _SseResponse(StreamingResponse):
    """A StreamingResponse that runs on_close when it ends for any reason (the client gone too)."""

    def __init__(self, content, on_close: Callable[[], None], headers: dict):
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def _json_body(request: Request, limit: int):
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise RequestTooLarge("body", f"larger than {limit} bytes")
    parts, total = [], 0
    async for part in request.stream():
        total += len(part)
        if total > limit:
            raise RequestTooLarge("body", f"larger than {limit} bytes")
        parts.append(part)
    try:
        return json.loads(b"".join(parts))
    except ValueError as exc:
        raise InvalidArgument("body", f"not valid JSON ({exc})") from None


def _peer(request: Request) -> str:
    """The client's connection, as the gRPC front counts it (gateway.max_streams_per_connection)."""
    client = request.client
    return f"http:{client.host}:{client.port}" if client is not None else ""


def _timeout(request: Request) -> float | None:
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgument(TIMEOUT_HEADER, "must be a number of seconds > 0")
    return value


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _first(request: Request, stream: ThreadStream):
    """The stream's first item; the client closing the connection first cancels the work."""
    getter = asyncio.ensure_future(stream.next())
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({getter, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        stream.cancel()
        raise
    finally:
        gone.cancel()
    if not getter.done():
        stream.cancel()
        getter.cancel()
        raise Cancelled("the client closed the connection")
    return getter.result()


class Handlers:
    def __init__(self, core, cfg, pool, state: FrontState):
        self.core, self.cfg, self.pool, self.state = core, cfg, pool, state
        self.created = int(time.time())

    def _error(self, call: HttpCall, exc: BaseException, parsed: Parsed | None) -> JSONResponse:
        err = http_error(exc, lambda f: openai_param(f, parsed))
        if not isinstance(exc, SpecmeshError) and err.status == 500:
            log.error("unhandled error in %s", call.route, exc_info=exc)
        call.finish(err.code, err.status, err.message)
        return JSONResponse(err.body, err.status, headers=err.headers)

    async def _authenticate(self, call: HttpCall, request: Request):
        if self.state.draining:
            raise Unavailable("gateway is shutting down; retry elsewhere")
        return await run_blocking(self.pool, call.context(), self.core.authenticate,
                                  bearer_token(request.headers.items()))

    async def chat(self, request: Request):
        return await self._generate(request, decode_chat)

    async def completions(self, request: Request):
        return await self._generate(request, decode_completion)

    async def _generate(self, request: Request, decode):
        call, parsed = HttpCall("POST", request.url.path, request.headers.items()), None
        try:
            record = await self._authenticate(call, request)  # the key first, as on gRPC
            body = await _json_body(request, self.cfg.http.max_request_bytes)
            parsed = decode(body, self.core.model, self.cfg.http.default_max_tokens)
            a = await run_blocking(self.pool, call.context(), self.core.admit, parsed.request, record,
                                   _timeout(request), _peer(request))
            enc = Encoder(parsed.chat, self.core.model, a.request.request_id, parsed.include_usage)
            headers = {"x-request-id": a.request.request_id}
            if parsed.stream:
                return await self._stream(request, call, a, enc, headers)
            work = ThreadStream(lambda watch: iter((self.core.generate(a, watch),)), self.pool, call.context())
            resp = await _first(request, work)
            call.finish("OK", 200)
            return JSONResponse(enc.response(resp), headers=headers)
        except Exception as exc:  # noqa: BLE001 - every error answers in OpenAI's shape
            return self._error(call, exc, parsed)

    async def _stream(self, request: Request, call: HttpCall, a, enc: Encoder, headers: dict):
        work = ThreadStream(lambda watch: self.core.stream(a, watch), self.pool, call.context())
        first = await _first(request, work)  # an error before any output is still an HTTP status

        async def body():
            try:
                role = enc.role()
                if role is not None:
                    yield sse(role)
                chunk = first
                while True:
                    for frame in enc.frames(chunk):
                        yield frame
                    if chunk.finish_reason:
                        break
                    chunk = await work.next()
                yield DONE
                call.finish("OK", 200)
            except Exception as exc:  # noqa: BLE001 - headers are sent: an SSE error event
                err = http_error(exc)
                call.finish(err.code, err.status, err.message)
                yield sse(err.body)

        def closed() -> None:
            work.cancel()  # no-op after the last chunk; else the coordinator stops and frees the KV
            call.finish("CANCELLED", 499, "the client closed the connection")

        return _SseResponse(body(), closed, {**headers, "cache-control": "no-cache"})

    async def models(self, request: Request):
        call = HttpCall("GET", "/v1/models", request.headers.items())
        try:
            await self._authenticate(call, request)
            call.finish("OK", 200)
            return JSONResponse(models_json(self.core.model, self.created))
        except Exception as exc:  # noqa: BLE001
            return self._error(call, exc, None)

    async def model(self, request: Request):
        call = HttpCall("GET", "/v1/models/{model}", request.headers.items())
        try:
            await self._authenticate(call, request)
            name = request.path_params["model"]
            if name != self.core.model:
                raise ModelNotFound(f"model {name!r} is not served here; this mesh serves {self.core.model!r}")
            call.finish("OK", 200)
            return JSONResponse(model_json(self.core.model, self.created))
        except Exception as exc:  # noqa: BLE001
            return self._error(call, exc, None)

    async def health(self, request: Request):
        ok = not self.state.draining and self.state.ready()
        return JSONResponse({"status": "serving" if ok else "not_serving"}, 200 if ok else 503)


async def _http_exception(request: Request, exc: HTTPException):
    """Routing errors (unknown path 404, wrong method 405) in OpenAI's error shape too."""
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, None)
    body = {"error": {"message": f"{request.method} {request.url.path}: {exc.detail}",
                      "type": "invalid_request_error", "param": None, "code": code}}
    return JSONResponse(body, exc.status_code, headers=getattr(exc, "headers", None))


def build_app(core, cfg, pool, state: FrontState) -> Starlette:
    """core: a gateway.core.GatewayCore; cfg: the MeshConfig; pool: the executor for blocking work."""
    h = Handlers(core, cfg, pool, state)
    routes = [
        Route("/v1/chat/completions", h.chat, methods=["POST"]),
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/v1/models/{model:path}", h.model, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_exception})
