"""Gateway servicer: authenticate, validate, admit (backpressure + rate limits), forward to the
coordinator, account. Entry `main`.

Per request: API key (auth.required) -> every field validated (INVALID_ARGUMENT names it) ->
an admission slot (max in-flight + bounded queue, else UNAVAILABLE) -> the key's rate limits
(one request, prompt + max_tokens tokens reserved; RESOURCE_EXHAUSTED + retry-after) -> the
coordinator, with the client's deadline clamped -> the unused tokens refunded. A client that
goes away cancels the coordinator's call, which stops generating and releases the sequence.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
import uuid

import grpc

from coordinator.observe import model_name
from gateway.admin import GatewayAdminServicer
from gateway.health import MeshProbe
from specmesh.auth.guard import Guard
from specmesh.auth.keys import bearer_token
from specmesh.config import ConfigError, MeshConfig
from specmesh.errors import Cancelled, ModelIntegrityError
from specmesh.rpc.admission import deadline_from
from specmesh.rpc.errors import raise_from_rpc
from specmesh.rpc.requests import Limits, decode_request
from specmesh.rpc.server import Service, make_channel, service_options
from specmesh.runtime import service_args, start_process
from specmesh.telemetry import context as reqctx
from specmesh.telemetry import genai, tracing
from specmesh.telemetry.workers import admission_limiter
from specmesh.tokenization import PromptEncoder, model_encoder
from specmesh.v1 import admin_pb2_grpc as apb_grpc
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Admitted:
    request: object  # the GenerateRequest forwarded (request_id filled in)
    timeout: float
    prompt_tokens: int
    max_tokens: int
    record: object  # KeyRecord | None


class GatewayServicer(pb_grpc.GatewayServicer):
    def __init__(self, cfg: MeshConfig, encoder: PromptEncoder, guard: Guard | None = None):
        self.cfg = cfg
        self.encoder = encoder
        self.limits = Limits(cfg.gateway.max_tokens_limit, cfg.gateway.max_stop_strings)
        self.guard = guard if guard is not None else Guard.from_config(cfg)  # no Redis traffic while auth is off
        self.admission = admission_limiter("gateway", cfg.backpressure.gateway)
        self.channel = make_channel(cfg.gateway.coordinator)
        self.coordinator = pb_grpc.CoordinatorStub(self.channel)
        self.admin = apb_grpc.AdminStub(self.channel)
        self.model = model_name(cfg)

    def _timeout(self, request, context):
        """Validate every field (INVALID_ARGUMENT names it); the client's deadline, clamped."""
        remaining = context.time_remaining()
        limit = self.cfg.gateway.max_deadline_s
        timeout = limit if remaining is None else min(remaining, limit)
        req = decode_request(request, self.encoder, self.limits, self.cfg.speculative, timeout)
        return timeout, req

    def _prepare(self, request, context) -> _Admitted:
        info = reqctx.current() or reqctx.RequestInfo("gateway", "Generate")
        rec = self.guard.authenticate(bearer_token(context.invocation_metadata()))
        if rec is not None:
            info.key_name = rec.name
        if not request.request_id:
            filled = pb.GenerateRequest()
            filled.CopyFrom(request)
            filled.request_id = uuid.uuid4().hex
            request = filled
        info.request_id = request.request_id
        timeout, req = self._timeout(request, context)
        tracing.set_attributes(genai.request_attributes(self.model, req, request.raw))
        info.update(prompt_tokens=len(req.prompt_ids), max_tokens=req.max_tokens)
        if self.cfg.logging.log_text:  # debug only
            info.update(prompt=request.prompt or [m.content for m in request.messages.messages])
        return _Admitted(request, timeout, len(req.prompt_ids), req.max_tokens, rec)

    def _finished(self, a: _Admitted, completion: int, finish_reason: str, spec, text: str | None = None) -> None:
        attrs = genai.response_attributes(a.prompt_tokens, completion, finish_reason, a.request.request_id)
        tracing.set_attributes({**attrs, **genai.spec_attributes_from_pb(spec)})
        info = reqctx.current()
        if info is not None:
            info.update(completion_tokens=completion, finish_reason=finish_reason, drafter=spec.method,
                        rounds=spec.rounds, drafted_tokens=spec.drafted_tokens, accepted_tokens=spec.accepted_tokens,
                        acceptance_length=round(spec.mean_acceptance_length, 3))
            if self.cfg.logging.log_text and text is not None:
                info.update(completion=text)

    def Generate(self, request, context):
        a = self._prepare(request, context)
        with self.admission.slot(deadline_from(context)):
            res = self.guard.reserve(a.record, a.prompt_tokens + a.max_tokens)
            used = a.prompt_tokens
            try:
                future = self.coordinator.Generate.future(a.request, timeout=a.timeout)
                context.add_callback(future.cancel)  # the client went away: stop the generation too
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

    def GenerateStream(self, request, context):
        a = self._prepare(request, context)
        with self.admission.slot(deadline_from(context)):
            res = self.guard.reserve(a.record, a.prompt_tokens + a.max_tokens)
            completion, started, text = 0, time.monotonic(), [] if self.cfg.logging.log_text else None
            info = reqctx.current()
            call = self.coordinator.GenerateStream(a.request, timeout=a.timeout)
            context.add_callback(call.cancel)  # the client went away: cancel the coordinator's stream too
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


def main(argv=None) -> int:
    args = service_args("specmesh gateway", argv)
    try:
        cfg = start_process("gateway", args)
        if args.listen:
            cfg = cfg.replace(gateway=dataclasses.replace(cfg.gateway, listen=args.listen))
        encoder = model_encoder(cfg.model)
        opts = service_options(cfg, "gateway")  # before any channel: mesh mTLS
    except (ConfigError, ModelIntegrityError, OSError) as exc:
        print(f"gateway: refusing to start: {exc}", file=sys.stderr)
        return 2
    servicer = GatewayServicer(cfg, encoder)

    def register(server) -> None:
        pb_grpc.add_GatewayServicer_to_server(servicer, server)
        apb_grpc.add_AdminServicer_to_server(GatewayAdminServicer(servicer.guard, servicer.admin), server)

    service = Service("specmesh.v1.Gateway", cfg.gateway.listen, register, cfg.gateway.max_workers,
                      ready_on_start=False, **opts)  # NOT_SERVING until the mesh probe succeeds
    service.start()
    probe = MeshProbe(servicer.coordinator, service.set_serving, cfg.health).start()
    service.wait_for_signal(on_drain=probe.stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
