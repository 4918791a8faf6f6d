"""Admin service on the coordinator: the speculation hot switch and canary (state held here),
and the canary's per-arm numbers (GetCanary, read from this process's metrics)."""

from __future__ import annotations

from coordinator.canary import CanaryBook
from coordinator.control import SpeculationControl, SpeculationState
from specmesh.core.canary import parse_keys
from specmesh.core.canary_stats import ArmStats
from specmesh.v1 import admin_pb2 as apb
from specmesh.v1 import admin_pb2_grpc as apb_grpc


def state_to_pb(s: SpeculationState, guard_margin: float | None = None) -> apb.SpeculationState:
    return apb.SpeculationState(enabled=s.enabled, method=s.method or "",
                                num_speculative_tokens=-1 if s.k is None else s.k, version=s.version,
                                share=s.canary.share, keys=list(s.canary.keys), guard_tripped=s.canary.tripped,
                                guard_margin=-1.0 if guard_margin is None else guard_margin)


def apply_request(control: SpeculationControl, request) -> SpeculationState:
    return control.set(
        enabled=request.enabled if request.HasField("enabled") else None,
        method=request.method if request.HasField("method") else None,
        k=request.num_speculative_tokens if request.HasField("num_speculative_tokens") else None,
        reset=request.reset,
        share=request.share if request.HasField("share") else None,
        keys=parse_keys(request.keys) if request.HasField("keys") else None)


def _histogram_pb(h) -> apb.Histogram:
    return apb.Histogram(upper_bounds=[le for le, _ in h], cumulative_counts=[c for _, c in h])


def arm_to_pb(arm: str, stats: ArmStats) -> apb.ArmStats:
    return apb.ArmStats(arm=arm, codes=stats.codes, tpot=_histogram_pb(stats.tpot), e2e=_histogram_pb(stats.e2e))


class CoordinatorAdminServicer(apb_grpc.AdminServicer):
    def __init__(self, control: SpeculationControl, book: CanaryBook | None = None,
                 guard_margin: float | None = None):
        self.control, self.guard_margin = control, guard_margin
        self.book = book or CanaryBook(control.configured)

    @classmethod
    def of(cls, servicer) -> "CoordinatorAdminServicer":
        """For a CoordinatorServicer: its control, canary book and guard margin."""
        return cls(servicer.control, servicer.canary_book, servicer.cfg.coordinator.canary.guard_margin)

    def GetSpeculation(self, request, context):
        return state_to_pb(self.control.state, self.guard_margin)

    def SetSpeculation(self, request, context):
        return state_to_pb(apply_request(self.control, request), self.guard_margin)

    def GetCanary(self, request, context):
        arms, window_s = self.book.report(since_start=request.since_start)
        return apb.CanaryReport(state=state_to_pb(self.control.state, self.guard_margin), window_s=window_s,
                                arms=[arm_to_pb(arm, stats) for arm, stats in arms.items()])
