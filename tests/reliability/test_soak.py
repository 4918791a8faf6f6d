"""The soak slice: 8 streaming clients for 60 s against the in-process mesh, a share of them
cancelled mid-stream and a share cut by their deadline. Nothing lost, the process's RSS / fds /
threads flat after warm-up (the CI slack: 10% or 64 MB), and at the end the target holds no
sequence and the draft tier keeps none (the full run: `specmesh chaos --parts soak`, 32 x 10 min,
RSS by the issue's bound, under 5%)."""

from __future__ import annotations

import pytest

from specmesh.reliability import soak

pytestmark = pytest.mark.service


def test_soak_slice(rmesh):
    res = soak.to_json(soak.run_soak(rmesh, clients=8, seconds=60, seed=3, cancel_share=0.25, deadline_share=0.15,
                                     sample_every_s=3), 8, 60, rss_slack=soak.CI_RSS_SLACK)
    assert res["lost"] == 0, res["lost_examples"]
    out = res["outcomes"]
    assert out["completed"] >= 8 and out.get("cancelled", 0) >= 1 and out.get("deadline", 0) >= 1, out
    assert res["end_state"] == "ok"  # the target and the draft tier hold nothing
    assert all(p["flat"] for p in res["processes"].values()), res["processes"]


def test_flatness_sees_growth():
    rows = [(t, 500_000 + t * 40_000, 50, 30) for t in range(10)]  # +40 MB a sample: a leak
    assert not soak.flatness(rows)["flat"]
    steady = [(t, 500_000, 50 + (t == 9), 30) for t in range(10)]
    assert soak.flatness(steady)["flat"]
    assert not soak.flatness([(t, 500_000, 50 + 3 * t, 30) for t in range(10)])["flat"]  # fds leak


def test_the_full_run_judges_rss_by_the_issues_five_percent():
    creep = [(t, 1_000_000 + (t >= 6) * 60_000, 50, 30) for t in range(10)]  # +6% (59 MB) after warm-up
    assert not soak.flatness(creep)["flat"]  # ISSUE_RSS_SLACK, the default
    assert soak.flatness(creep, rss_slack=soak.CI_RSS_SLACK)["flat"]  # the CI slice: 10% or 64 MB
    assert soak.flatness([(t, 1_000_000 + (t >= 6) * 40_000, 50, 30) for t in range(10)])["flat"]  # +4%
    res = soak.to_json(soak.SoakResult(samples={"p": creep}), 1, 60)
    assert res["rss_slack"] == {"share": 0.05, "mb": 0} and not res["passed"]
