"""Admin service on the public port: an admin API key is required (always, whatever auth mode);
the call is forwarded to the coordinator, which holds the state. With several coordinators named
(gateway.coordinator "ip:port,ip:port") SetSpeculation is set on each, in order, and the reads
answer from the first."""

from __future__ import annotations

import logging

import grpc

from specmesh.auth.keys import bearer_token
from specmesh.rpc.errors import raise_from_rpc
from specmesh.telemetry import context as reqctx
from specmesh.v1 import admin_pb2_grpc as apb_grpc

log = logging.getLogger(__name__)


class GatewayAdminServicer(apb_grpc.AdminServicer):
    def __init__(self, guard, admin_stubs: list, max_deadline_s: float = 30.0):
        """admin_stubs: one per coordinator the gateway names (GatewayCore.admins)."""
        self.guard, self.stubs, self.max_deadline_s = guard, admin_stubs, max_deadline_s
        self.stub = admin_stubs[0]

    def _authorize(self, context) -> str:
        rec = self.guard.authenticate(bearer_token(context.invocation_metadata()), admin=True)
        info = reqctx.current()
        if info is not None:
            info.key_name = rec.name
        return rec.name

    def _timeout(self, context) -> float:
        left = context.time_remaining()
        return self.max_deadline_s if left is None else min(left, self.max_deadline_s)

    def GetSpeculation(self, request, context):
        self._authorize(context)
        try:
            return self.stub.GetSpeculation(request, timeout=self._timeout(context))
        except grpc.RpcError as err:
            raise_from_rpc(err, "coordinator")

    def GetCanary(self, request, context):
        self._authorize(context)
        try:
            return self.stub.GetCanary(request, timeout=self._timeout(context))
        except grpc.RpcError as err:
            raise_from_rpc(err, "coordinator")

    def SetSpeculation(self, request, context):
        who = self._authorize(context)
        try:
            state = [s.SetSpeculation(request, timeout=self._timeout(context)) for s in self.stubs][0]
        except grpc.RpcError as err:
            raise_from_rpc(err, "coordinator")
        keys = ",".join(state.keys) or "(all)"
        log.info("admin %s set speculation: enabled=%s method=%s k=%d canary share=%s keys=%s (version %d)", who,
                 state.enabled, state.method or "(request's)", state.num_speculative_tokens, state.share, keys,
                 state.version,
                 extra={"fields": {"event": "speculation_switch", "enabled": state.enabled, "method": state.method,
                                   "k": state.num_speculative_tokens, "version": state.version,
                                   "canary_share": state.share, "canary_keys": list(state.keys)}})
        return state
