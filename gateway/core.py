"""The gateway's request path, shared by both public fronts (gRPC and the OpenAI-compatible HTTP):
authenticate, validate, admit (backpressure + rate limits), forward to the coordinator, account.

Per request: API key (auth.required) -> every field validated (INVALID_ARGUMENT names it) ->
an admission slot (max in-flight + bounded queue, else UNAVAILABLE) -> the key's rate limits
(one request, prompt + max_tokens tokens reserved; RESOURCE_EXHAUSTED + retry-after) -> the
coordinator, with the client's deadline clamped -> the unused tokens refunded. A client that
goes away cancels the coordinator's call, which stops generating and releases the sequence.

No transport here: a front passes the API key (authenticate, first), the client's remaining
time (admit) and a `watch` callable (generate / stream): watch(cancel) registers `cancel` to be
called when the front's client goes away.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from typing import Callable, Iterator

import grpc

from coordinator.observe import model_name
from gateway.streams import StreamLimits
from specmesh.auth.guard import Guard
from specmesh.config import MeshConfig
from specmesh.errors import Cancelled
from specmesh.rpc.errors import raise_from_rpc
from specmesh.rpc.requests import Limits, decode_request, valid_request_id
from specmesh.rpc.server import make_channel
from specmesh.telemetry import context as reqctx
from specmesh.telemetry import genai, tracing
from specmesh.telemetry.workers import admission_limiter
from specmesh.tokenization import PromptEncoder
from specmesh.v1 import admin_pb2_grpc as apb_grpc
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

Watch = Callable[[Callable[[], object]], object]  # watch(cancel): call cancel when the client goes away


@dataclasses.dataclass
class Admitted:
    request: object  # the GenerateRequest forwarded (request_id filled in)
    timeout: float  # seconds the coordinator gets (the client's deadline, clamped)
    deadline: float | None  # the client's own deadline (time.monotonic()); None: it set none
    prompt_tokens: int
    max_tokens: int
    record: object  # KeyRecord | None
    peer: str = ""  # the client's connection (gateway.max_streams_per_connection); "": not counted


class GatewayCore:
    def __init__(self, cfg: MeshConfig, encoder: PromptEncoder, guard: Guard | None = None):
        self.cfg = cfg
        self.encoder = encoder
        self.limits = Limits.from_config(cfg.gateway)
        self.guard = guard if guard is not None else Guard.from_config(cfg)  # no Redis traffic while auth is off
        self.admission = admission_limiter("gateway", cfg.backpressure.gateway)
        self.streams = StreamLimits(cfg.gateway.max_streams_per_connection, cfg.gateway.max_streams_per_key)
        self.channel = make_channel(cfg.gateway.coordinator)
        self.coordinator = pb_grpc.CoordinatorStub(self.channel)
        # Admin: one stub per coordinator named (a switch is set on each); one for a dns:/// target
        coords = cfg.gateway.coordinator.split(",")
        self.admin_channels = [make_channel(a) for a in coords] if len(coords) > 1 else [self.channel]
        self.admins = [apb_grpc.AdminStub(ch) for ch in self.admin_channels]
        self.model = model_name(cfg)

    def authenticate(self, api_key: str | None):
        """The key's KeyRecord (None while auth is off); its name goes into the request's logs."""
        rec = self.guard.authenticate(api_key)
        info = reqctx.current()
        if rec is not None and info is not None:
            info.key_name = rec.name
        return rec

    def admit(self, request, record, remaining_s: float | None, peer: str = "") -> Admitted:
        """Fill in the request id, validate every field (after authenticate); nothing is reserved yet.
        peer: the client's connection, for gateway.max_streams_per_connection ("": not counted)."""
        info = reqctx.current() or reqctx.RequestInfo("gateway", "Generate")
        if not request.request_id:
            filled = pb.GenerateRequest()
            filled.CopyFrom(request)
            filled.request_id = uuid.uuid4().hex
            request = filled
        # logged and forwarded: only a valid one (a refused request's id may be 1 MB of anything)
        info.request_id = request.request_id if valid_request_id(request.request_id, self.limits) else "(invalid)"
        limit = self.cfg.gateway.max_deadline_s
        timeout = limit if remaining_s is None else min(remaining_s, limit)
        req = decode_request(request, self.encoder, self.limits, self.cfg.speculative, timeout)
        tracing.set_attributes(genai.request_attributes(self.model, req, request.raw))
        info.update(prompt_tokens=len(req.prompt_ids), max_tokens=req.max_tokens)
        if self.cfg.logging.log_text:  # debug only
            info.update(prompt=request.prompt or [m.content for m in request.messages.messages])
        deadline = None if remaining_s is None else time.monotonic() + remaining_s
        return Admitted(request, timeout, deadline, len(req.prompt_ids), req.max_tokens, record, peer)

    def _finished(self, a: Admitted, completion: int, finish_reason: str, spec, text: str | None = None) -> None:
        attrs = genai.response_attributes(a.prompt_tokens, completion, finish_reason, a.request.request_id)
        tracing.set_attributes({**attrs, **genai.spec_attributes_from_pb(spec)})
        info = reqctx.current()
        if info is not None:
            info.update(completion_tokens=completion, finish_reason=finish_reason, drafter=spec.method,
                        rounds=spec.rounds, drafted_tokens=spec.drafted_tokens, accepted_tokens=spec.accepted_tokens,
                        acceptance_length=round(spec.mean_acceptance_length, 3))
            if self.cfg.logging.log_text and text is not None:
                info.update(completion=text)

    @contextlib.contextmanager
    def _slots(self, a: Admitted):
        """Per connection and per key first (RESOURCE_EXHAUSTED), then the gateway's admission."""
        key = a.record.key_hash if a.record is not None else None
        with self.streams.slot(a.peer, key), self.admission.slot(a.deadline):
            yield

    def generate(self, a: Admitted, watch: Watch) -> pb.GenerateResponse:
        with self._slots(a):
            res = self.guard.reserve(a.record, a.prompt_tokens + a.max_tokens)
            used = a.prompt_tokens
            try:
                future = self.coordinator.Generate.future(a.request, timeout=a.timeout)
                watch(future.cancel)  # the client went away: stop the generation too
                try:
                    resp = future.result()
                except grpc.FutureCancelledError:
                    raise Cancelled("the client cancelled the request") from None
                except grpc.RpcError as err:
                    raise_from_rpc(err, "coordinator")
                used += resp.usage.completion_tokens
                self._finished(a, resp.usage.completion_tokens, resp.finish_reason, resp.spec, resp.text)
                return resp
            finally:
                self.guard.refund(res, used)

    def stream(self, a: Admitted, watch: Watch) -> Iterator[pb.GenerateChunk]:
        with self._slots(a):
            res = self.guard.reserve(a.record, a.prompt_tokens + a.max_tokens)
            completion, started, text = 0, time.monotonic(), [] if self.cfg.logging.log_text else None
            info = reqctx.current()
            call = self.coordinator.GenerateStream(a.request, timeout=a.timeout)
            watch(call.cancel)  # the client went away: cancel the coordinator's stream too
            try:
                for chunk in call:
                    if completion == 0 and chunk.token_ids and info is not None:
                        info.update(ttft_ms=round((time.monotonic() - started) * 1000, 2))
                    completion += len(chunk.token_ids)
                    if text is not None:
                        text.append(chunk.text)
                    if chunk.finish_reason:
                        self._finished(a, chunk.usage.completion_tokens, chunk.finish_reason, chunk.spec,
                                       None if text is None else "".join(text))
                    yield chunk
            except grpc.RpcError as err:
                raise_from_rpc(err, "coordinator")
            finally:
                call.cancel()  # no-op once finished; stops the generation if we stop early
                self.guard.refund(res, a.prompt_tokens + completion)
