"""The faults slice: `specmesh chaos --parts faults --faults kills` as a user runs it: a mesh of two
replicas per tier under 16 streaming clients, one kill -9 per tier (draft, target, coordinator,
gateway), each restarted. No call may hang or differ from the fault-free output at T=0, none may
fail once the client has retried, and every process serves afterwards with nothing held."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]


def test_one_kill_per_tier_under_load(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "specmesh.cli", "chaos", "--parts", "faults", "--faults", "kills",
                           "--out", str(out), "--workdir", str(tmp_path / "wd")],
                          capture_output=True, text=True, timeout=900)
    tail = "\n".join(line for line in proc.stderr.splitlines() if line.startswith(("faults:", "chaos:")))
    res = json.loads((out / "faults.json").read_text())
    assert [e["fault"] for e in res["episodes"]] == [f"kill -9 {t}" for t in
                                                    ("draft_worker", "target_worker", "coordinator", "gateway")]
    for e in res["episodes"]:
        assert e["hung"] == 0 and e["differs"] == 0, (e, tail)
        assert e["failed"] == {} and e["ok"] == e["calls"] > 0, (e, tail)
    # the kills hit calls in flight: the client's retry was needed where a front tier died
    assert sum(e["ok_after_retry"] for e in res["episodes"]) > 0, tail
    assert res["after"] == {"processes": "ok", "sequences_released": "ok", "generation_unchanged": "ok"}, res["after"]
    assert proc.returncode == 0, tail
