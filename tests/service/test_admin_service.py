"""The speculation hot switch through a real in-process mesh: Admin on the gateway (admin key from
a real redis-server) -> Admin on the coordinator -> the next rounds; stats, metrics, the CLI."""

from __future__ import annotations

import json

import grpc
import pytest
from prometheus_client import REGISTRY

from prod_helpers import bearer, make_config, redis_server, start_mesh  # noqa: F401
from specmesh.auth.guard import Guard
from specmesh.auth.store import KeyStore, connect
from specmesh.v1 import admin_pb2 as apb
from specmesh.v1 import specmesh_pb2 as pb

pytestmark = pytest.mark.service
PROMPT = "Repeat exactly: one two three one two three one two three"


@pytest.fixture(scope="module")
def admin_mesh(target_model, prompt_encoder, redis_server):  # noqa: F811
    over = {"auth": {"redis_url": redis_server.url, "key_prefix": "admintest"}}
    guard = Guard.from_config(make_config(over), environ={})  # auth not required; Admin still needs a key
    mesh = start_mesh(target_model, prompt_encoder, over, guard=guard)
    store = KeyStore(connect(redis_server.url), "admintest")
    admin_key, _ = store.create("ops", admin=True)
    user_key, _ = store.create("user")
    yield mesh, admin_key, user_key
    mesh.stop()


def generate(mesh):
    return mesh.gateway_stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_tokens=8), timeout=120)


def gauge(name):
    return REGISTRY.get_sample_value(name)


def test_switch_off_and_on_between_two_requests(admin_mesh):
    mesh, admin_key, _ = admin_mesh
    on = generate(mesh)
    assert on.spec.method == "ngram" and on.spec.drafted_tokens > 0
    state = mesh.admin_stub.SetSpeculation(apb.SetSpeculationRequest(enabled=False), timeout=30,
                                           metadata=bearer(admin_key))
    assert not state.enabled and state.version >= 1
    assert gauge("specmesh_speculation_enabled") == 0
    off = generate(mesh)
    assert off.spec.method == "off" and off.spec.drafted_tokens == 0 and off.spec.rounds > 0
    assert list(off.token_ids) == list(on.token_ids)  # T=0: the target decides, with or without drafts
    state = mesh.admin_stub.SetSpeculation(apb.SetSpeculationRequest(enabled=True, num_speculative_tokens=2),
                                           timeout=30, metadata=bearer(admin_key))
    assert state.enabled and state.num_speculative_tokens == 2
    assert gauge("specmesh_speculation_enabled") == 1 and gauge("specmesh_speculation_num_speculative_tokens") == 2
    again = generate(mesh)
    assert again.spec.method == "ngram" and again.spec.drafted_tokens > 0
    assert len(again.spec.drafted_per_position) <= 2  # k = 2 per round now
    got = mesh.admin_stub.GetSpeculation(apb.GetSpeculationRequest(), timeout=30, metadata=bearer(admin_key))
    assert got == state
    reset = mesh.admin_stub.SetSpeculation(apb.SetSpeculationRequest(reset=True), timeout=30,
                                           metadata=bearer(admin_key))
    assert reset.enabled and reset.num_speculative_tokens == -1 and reset.method == ""


def test_admin_rejects_bad_values_and_non_admin_keys(admin_mesh):
    mesh, admin_key, user_key = admin_mesh
    with pytest.raises(grpc.RpcError) as exc:
        mesh.admin_stub.SetSpeculation(apb.SetSpeculationRequest(method="magic"), timeout=30,
                                       metadata=bearer(admin_key))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as exc:
        mesh.admin_stub.SetSpeculation(apb.SetSpeculationRequest(enabled=False), timeout=30,
                                       metadata=bearer(user_key))
    assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert mesh.coordinator.control.state.enabled


def test_admin_cli(admin_mesh, capsys):
    from specmesh.cli import main

    mesh, admin_key, _ = admin_mesh
    target = ["--target", mesh.services["gateway"].listen, "--api-key", admin_key]
    assert main(["admin", "speculation", "--off", *target]) == 0
    assert json.loads(capsys.readouterr().out)["enabled"] is False
    assert main(["admin", "speculation", *target]) == 0
    assert json.loads(capsys.readouterr().out)["enabled"] is False
    assert main(["admin", "speculation", "--on", "--method", "ngram", "--k", "3", *target]) == 0
    state = json.loads(capsys.readouterr().out)
    assert state == {"enabled": True, "method": "ngram", "num_speculative_tokens": 3, "version": state["version"],
                     "share": 1.0, "keys": [], "guard_tripped": None}
    assert main(["admin", "speculation", "--off", "--target", mesh.services["gateway"].listen]) == 1
    assert capsys.readouterr().err.startswith("UNAUTHENTICATED")
    assert main(["admin", "speculation", "--reset", *target]) == 0
