"""The speculation canary through a real in-process mesh (real model, real redis-server for the
API keys): `specmesh admin speculation --share/--keys` via the gateway's Admin service, requests
from two keys, both arms in the coordinator's metrics and in `specmesh admin canary`."""

from __future__ import annotations

import json

import pytest
from prometheus_client import REGISTRY

from prod_helpers import bearer, make_config, redis_server, start_mesh  # noqa: F401
from specmesh.auth.guard import Guard
from specmesh.auth.store import KeyStore, connect
from specmesh.cli import main
from specmesh.core.canary import hash_fraction
from specmesh.v1 import specmesh_pb2 as pb

pytestmark = pytest.mark.service
PROMPT = "Repeat exactly: one two three one two three one two three"


@pytest.fixture(scope="module")
def canary_mesh(target_model, prompt_encoder, redis_server):  # noqa: F811
    over = {"auth": {"required": True, "redis_url": redis_server.url, "key_prefix": "canarytest"}}
    mesh = start_mesh(target_model, prompt_encoder, over, guard=Guard.from_config(make_config(over), environ={}))
    store = KeyStore(connect(redis_server.url), "canarytest")
    keys = {name: store.create(name, admin=name == "ops")[0] for name in ("ops", "team-a", "team-b")}
    yield mesh, keys
    mesh.stop()


def admin(mesh, keys, capsys, *args) -> tuple[int, str]:
    rc = main(["admin", *args, "--target", mesh.services["gateway"].listen, "--api-key", keys["ops"]])
    return rc, capsys.readouterr().out


def generate(mesh, key: str, request_id: str, method: str | None = None):
    req = pb.GenerateRequest(prompt=PROMPT, max_tokens=6, request_id=request_id)
    if method:
        req.speculation.method = method
    return mesh.gateway_stub.Generate(req, timeout=120, metadata=bearer(key))


def ids(n_spec: int, n_control: int, share: float, tag: str) -> list[tuple[str, str]]:
    """Request ids whose hash puts them in each arm at this share."""
    spec = [f"{tag}-{i}" for i in range(1000) if hash_fraction(f"{tag}-{i}") < share][:n_spec]
    control = [f"{tag}-{i}" for i in range(1000) if hash_fraction(f"{tag}-{i}") >= share][:n_control]
    return [(i, "spec") for i in spec] + [(i, "control") for i in control]


def requests_total(arm: str) -> float:
    return REGISTRY.get_sample_value("specmesh_requests_total", {"arm": arm, "code": "OK"}) or 0.0


def test_share_splits_requests_into_both_arms(canary_mesh, capsys):
    mesh, keys = canary_mesh
    rc, out = admin(mesh, keys, capsys, "speculation", "--share", "0.5")
    assert rc == 0 and json.loads(out)["share"] == 0.5
    before = {arm: requests_total(arm) for arm in ("spec", "control")}
    tokens = set()
    for rid, arm in ids(5, 5, 0.5, "split"):
        resp = generate(mesh, keys["team-a"], rid)
        assert resp.spec.arm == arm, rid
        assert (resp.spec.method, resp.spec.drafted_tokens == 0) == (("ngram", False) if arm == "spec" else ("off", True))
        tokens.add(tuple(resp.token_ids))
    assert len(tokens) == 1  # T=0: both arms answer the same tokens
    assert {arm: requests_total(arm) - before[arm] for arm in before} == {"spec": 5, "control": 5}

    rc, out = admin(mesh, keys, capsys, "canary", "--json")
    report = json.loads(out)
    assert rc == 0 and report["coordinators"][0]["share"] == 0.5
    for arm in ("spec", "control"):  # the window since the share was set: exactly these requests
        s = report["arms"][arm]
        assert (s["requests"], s["errors"], s["tpot_samples"]) == (5, 0, 5), arm
        assert 0 < s["tpot_p50_s"] <= s["tpot_p99_s"] and 0 < s["e2e_p50_s"] <= s["e2e_p99_s"]
    rc, out = admin(mesh, keys, capsys, "canary")
    lines = out.splitlines()
    assert rc == 0 and "share 0.5" in lines[0] and "guard off" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["spec"][1:4] == ["5", "0", "0.0%"] and rows["control"][1:4] == ["5", "0", "0.0%"]


def test_keys_limit_the_canary_and_opt_outs_stay_off(canary_mesh, capsys):
    mesh, keys = canary_mesh
    rc, out = admin(mesh, keys, capsys, "speculation", "--share", "1", "--keys", "team-a")
    assert rc == 0 and json.loads(out)["keys"] == ["team-a"]
    assert generate(mesh, keys["team-a"], "keys-1").spec.arm == "spec"
    other = generate(mesh, keys["team-b"], "keys-1")
    assert other.spec.arm == "control" and other.spec.method == "off"
    opt_out = generate(mesh, keys["team-a"], "keys-2", method="off")
    assert opt_out.spec.arm == "control" and opt_out.spec.drafted_tokens == 0
    rc, out = admin(mesh, keys, capsys, "canary", "--json")
    assert {arm: s["requests"] for arm, s in json.loads(out)["arms"].items()} == {"spec": 1, "control": 2}


def test_bad_share_and_non_admin_keys_are_refused(canary_mesh, capsys):
    mesh, keys = canary_mesh
    state = mesh.coordinator.control.state
    assert main(["admin", "speculation", "--share", "1.5", "--target", mesh.services["gateway"].listen,
                 "--api-key", keys["ops"]]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert main(["admin", "canary", "--target", mesh.services["gateway"].listen, "--api-key", keys["team-a"]]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err
    assert mesh.coordinator.control.state == state
    rc, out = admin(mesh, keys, capsys, "speculation", "--reset")
    assert rc == 0 and json.loads(out)["share"] == 1.0 and json.loads(out)["keys"] == []
