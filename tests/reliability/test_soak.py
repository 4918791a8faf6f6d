"""The soak slice: 8 streaming clients for 45 s against the in-process mesh, a share of them
cancelled mid-stream. Nothing lost, the process's RSS / fds / threads flat after warm-up, and the
target holds no sequence at the end (the full run: `specmesh chaos --parts soak`, 32 x 10 min)."""

from __future__ import annotations

import pytest

from specmesh.reliability import soak

pytestmark = pytest.mark.service


def test_soak_slice(rmesh):
    res = soak.to_json(soak.run_soak(rmesh, clients=8, seconds=45, seed=3, cancel_share=0.25, sample_every_s=3),
                       8, 45)
    assert res["lost"] == 0, res["lost_examples"]
    assert res["outcomes"]["completed"] >= 8 and res["outcomes"].get("cancelled", 0) >= 1, res["outcomes"]
    assert res["end_state"] == "ok"
    assert all(p["flat"] for p in res["processes"].values()), res["processes"]


def test_flatness_sees_growth():
    rows = [(t, 500_000 + t * 40_000, 50, 30) for t in range(10)]  # +40 MB a sample: a leak
    assert not soak.flatness(rows)["flat"]
    steady = [(t, 500_000, 50 + (t == 9), 30) for t in range(10)]
    assert soak.flatness(steady)["flat"]
    assert not soak.flatness([(t, 500_000, 50 + 3 * t, 30) for t in range(10)])["flat"]  # fds leak
