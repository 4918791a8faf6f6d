"""coordinator/canary.py on the real metric families: read_arms, the CanaryBook's window, and the
guard thread's check tripping a real SpeculationControl; the CLI's merge and table."""

from __future__ import annotations

import logging
import math

from prometheus_client import REGISTRY

from coordinator.canary import CanaryBook, CanaryGuard, read_arms
from coordinator.control import SpeculationControl
from specmesh.admin_cli import format_table, merge_reports
from specmesh.core.canary import Canary
from specmesh.telemetry import metrics
from specmesh.v1 import admin_pb2 as apb


def observe(arm: str, tpot_s: float, n: int, code: str = "OK") -> None:
    for _ in range(n):
        metrics.TPOT.labels(arm).observe(tpot_s)
        metrics.E2E.labels(arm).observe(tpot_s * 20)
        metrics.REQUESTS.labels(arm, code).inc()


def test_read_arms_follows_the_metric_families():
    before = read_arms()
    observe("spec", 0.02, 3)
    observe("control", 0.04, 2, code="UNAVAILABLE")
    win = {arm: s.since(before[arm]) for arm, s in read_arms().items()}
    assert win["spec"].codes.get("OK") == 3 and win["spec"].errors == 0
    assert win["control"].errors == 2 and win["control"].error_rate == 1.0
    assert win["spec"].tpot[-1] == (math.inf, 3.0)
    total = REGISTRY.get_sample_value("specmesh_tpot_seconds_count", {"arm": "spec"})
    assert read_arms()["spec"].tpot[-1][1] == total


def test_book_windows_start_at_admin_changes_not_at_trips():
    control = SpeculationControl(16, canary=Canary(1.0))
    book = CanaryBook(control.configured)
    observe("spec", 0.02, 2)
    arms, _ = book.report()
    start_count = arms["spec"].requests  # since start: includes every earlier request of the process
    assert start_count >= 2
    book.changed(control.set(share=0.5))
    observe("spec", 0.02, 4)
    observe("control", 0.03, 1)
    arms, window_s = book.report()
    assert arms["spec"].requests == 4 and arms["control"].requests == 1 and window_s >= 0
    book.changed(control.trip("slow"))  # a trip keeps the window that tripped it
    assert book.report()[0]["spec"].requests == 4
    assert book.report(since_start=True)[0]["spec"].requests >= start_count + 4


def test_guard_trips_the_share_to_zero_and_counts_it(caplog):
    control = SpeculationControl(16, canary=Canary(0.5))
    guard = CanaryGuard(control, margin=0.2, min_requests=10, interval_s=60)
    trips = REGISTRY.get_sample_value("specmesh_canary_guard_trips_total") or 0.0
    assert guard.check() is None  # the first look starts the window
    observe("spec", 0.012, 10)
    observe("control", 0.011, 10)
    v = guard.check()  # same bucket: within the margin; the window restarts
    assert v.ready and not v.trip and control.state.canary.share == 0.5
    observe("spec", 0.090, 4)  # fewer than min_requests in the new window: no verdict yet
    observe("control", 0.011, 12)
    assert not guard.check().ready
    observe("spec", 0.090, 8)
    with caplog.at_level(logging.WARNING, logger="coordinator.canary"):
        v = guard.check()
    assert v.trip and control.state.canary.share == 0.0 and "exceeds" in control.state.canary.tripped
    assert "canary guard tripped" in caplog.text
    assert REGISTRY.get_sample_value("specmesh_canary_guard_trips_total") == trips + 1
    assert guard.check() is None  # the trip changed the canary: a new window, share 0 judges nothing


def test_guard_restarts_its_window_when_an_admin_changes_the_share():
    control = SpeculationControl(16, canary=Canary(0.5))
    guard = CanaryGuard(control, margin=0.1, min_requests=5, interval_s=60)
    guard.check()
    observe("spec", 0.3, 10)  # slow, but then an admin changes the share before the guard looks
    observe("control", 0.01, 10)
    control.set(share=0.25)
    assert guard.check() is None and control.state.canary.share == 0.25
    observe("spec", 0.01, 5)
    observe("control", 0.01, 5)
    assert not guard.check().trip  # the slow requests belonged to the old window


def report(arm_counts: dict) -> apb.CanaryReport:
    bounds = [0.01, 0.05, math.inf]
    arms = [apb.ArmStats(arm=arm, codes={"OK": n, "INTERNAL": errs},
                         tpot=apb.Histogram(upper_bounds=bounds, cumulative_counts=[0, n, n]),
                         e2e=apb.Histogram(upper_bounds=bounds, cumulative_counts=[0, 0, n]))
            for arm, (n, errs) in arm_counts.items()]
    return apb.CanaryReport(state=apb.SpeculationState(share=0.5, guard_margin=-1), arms=arms, window_s=30)


def test_cli_merges_coordinators_and_prints_both_arms():
    arms = merge_reports([report({"spec": (10, 0), "control": (8, 2)}), report({"spec": (6, 0), "control": (4, 0)})])
    assert arms["spec"].requests == 16 and arms["control"].requests == 14 and arms["control"].errors == 2
    lines = format_table(arms)
    assert lines[0].split()[:4] == ["arm", "requests", "errors", "error"]
    spec, control = lines[1].split(), lines[2].split()
    assert spec[:4] == ["spec", "16", "0", "0.0%"] and control[:4] == ["control", "14", "2", "14.3%"]
    assert spec[4:6] == ["30.0", "ms"]  # p50 of 16 samples in (10, 50] ms: the bucket's middle
    empty = format_table(merge_reports([]))
    assert empty[1].split() == ["spec", "0", "0", "-", "-", "-", "-", "-"]


def test_cli_flags_become_one_request_for_every_target():
    from specmesh.cli import parser

    args = parser().parse_args(["admin", "speculation", "--share", "0.05", "--keys", "team-a,team-b",
                                "--target", "a:1,b:2", "--target", "c:3"])
    from specmesh.admin_cli import _targets, speculation_request

    req = speculation_request(args)
    assert _targets(args) == ["a:1", "b:2", "c:3"]
    assert req.share == 0.05 and req.keys == "team-a,team-b" and not req.HasField("enabled")
    show = parser().parse_args(["admin", "speculation"])
    assert speculation_request(show) is None and _targets(show) == ["127.0.0.1:50051"]
    clear = speculation_request(parser().parse_args(["admin", "speculation", "--keys", ""]))
    assert clear.HasField("keys") and clear.keys == ""
