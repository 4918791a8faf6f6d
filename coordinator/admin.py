"""Admin service on the coordinator: the speculation hot switch (state held here)."""

from __future__ import annotations

from coordinator.control import SpeculationControl, SpeculationState
from specmesh.v1 import admin_pb2 as apb
from specmesh.v1 import admin_pb2_grpc as apb_grpc


def state_to_pb(s: SpeculationState) -> apb.SpeculationState:
    return apb.SpeculationState(enabled=s.enabled, method=s.method or "",
                                num_speculative_tokens=-1 if s.k is None else s.k, version=s.version)


def apply_request(control: SpeculationControl, request) -> SpeculationState:
    return control.set(
        enabled=request.enabled if request.HasField("enabled") else None,
        method=request.method if request.HasField("method") else None,
        k=request.num_speculative_tokens if request.HasField("num_speculative_tokens") else None,
        reset=request.reset)


class CoordinatorAdminServicer(apb_grpc.AdminServicer):
    def __init__(self, control: SpeculationControl):
        self.control = control

    def GetSpeculation(self, request, context):
        return state_to_pb(self.control.state)

    def SetSpeculation(self, request, context):
        return state_to_pb(apply_request(self.control, request))
