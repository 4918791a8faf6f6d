"""API keys at a real gateway (real gRPC, real redis-server on a free port, a fake coordinator):
missing / unknown / revoked keys, the key name in metadata and logs (never the key), admin rights,
and the `specmesh keys` commands."""

from __future__ import annotations

import io
import json
import logging
from types import SimpleNamespace

import grpc
import pytest

from prod_helpers import (FakeCoordinator, Started, bearer, gateway_stub, make_config, redis_server,  # noqa: F401
                          start_fake_coordinator, start_gateway)
from specmesh.auth.store import KeyStore, connect
from specmesh.logs import JsonFormatter
from specmesh.telemetry import context as reqctx
from specmesh.v1 import admin_pb2 as apb
from specmesh.v1 import admin_pb2_grpc as apb_grpc
from specmesh.v1 import specmesh_pb2 as pb

pytestmark = pytest.mark.service
PREFIX = "authtest"


@pytest.fixture(scope="module")
def stack(redis_server, prompt_encoder):  # noqa: F811
    started = Started()
    fake = FakeCoordinator(completion=2)
    coordinator = start_fake_coordinator(fake, started)
    cfg = make_config({"auth": {"required": True, "redis_url": redis_server.url, "key_prefix": PREFIX},
                       "gateway": {"coordinator": coordinator}})
    _, svc = start_gateway(cfg, prompt_encoder, started)
    store = KeyStore(connect(redis_server.url), PREFIX)
    stub = gateway_stub(svc.listen, started)
    admin = apb_grpc.AdminStub(started.channels[-1])
    yield SimpleNamespace(fake=fake, store=store, stub=stub, admin=admin, address=svc.listen)
    started.stop()


def req(prompt="hello there", max_tokens=4):
    return pb.GenerateRequest(prompt=prompt, max_tokens=max_tokens)


def code_of(fn, *args, **kwargs):
    with pytest.raises(grpc.RpcError) as exc:
        out = fn(*args, **kwargs)
        if hasattr(out, "__iter__") and not isinstance(out, pb.GenerateResponse):
            list(out)
    return exc.value.code()


def test_missing_key_is_unauthenticated(stack):
    calls = len(stack.fake.metadata)
    assert code_of(stack.stub.Generate, req(), timeout=30) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(stack.stub.GenerateStream, req(), timeout=30) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(stack.stub.Generate, req(), timeout=30, metadata=[("authorization", "Basic x")]) \
        == grpc.StatusCode.UNAUTHENTICATED
    assert len(stack.fake.metadata) == calls  # nothing reached the coordinator


def test_unknown_key_is_unauthenticated_and_checked_before_validation(stack):
    assert code_of(stack.stub.Generate, req(), timeout=30, metadata=bearer("smk_nope")) \
        == grpc.StatusCode.UNAUTHENTICATED
    bad = pb.GenerateRequest(prompt="", max_tokens=0)  # invalid, but the key is checked first
    assert code_of(stack.stub.Generate, bad, timeout=30) == grpc.StatusCode.UNAUTHENTICATED


def test_valid_key_passes_and_only_its_name_travels(stack):
    key, rec = stack.store.create("svc-alice")
    resp = stack.stub.Generate(req(), timeout=30, metadata=bearer(key))
    assert resp.finish_reason == "length" and resp.request_id
    md = stack.fake.metadata[-1]
    assert md[reqctx.KEY_NAME_KEY] == "svc-alice"
    assert md[reqctx.REQUEST_ID_KEY] == resp.request_id
    assert "authorization" not in md and key not in json.dumps(md)
    chunks = list(stack.stub.GenerateStream(req(), timeout=30, metadata=bearer(key)))
    assert chunks[-1].finish_reason == "length"


def test_revoked_key_is_refused_on_the_next_request(stack):
    key, _ = stack.store.create("svc-bob")
    stack.stub.Generate(req(), timeout=30, metadata=bearer(key))
    assert stack.store.revoke("svc-bob").revoked
    assert code_of(stack.stub.Generate, req(), timeout=30, metadata=bearer(key)) == grpc.StatusCode.UNAUTHENTICATED


def test_clients_cannot_spoof_the_key_name(stack):
    key, _ = stack.store.create("svc-carol")
    stack.stub.Generate(req(), timeout=30, metadata=bearer(key) + [(reqctx.KEY_NAME_KEY, "someone-else"),
                                                                    (reqctx.PROBE_KEY, "1")])
    md = stack.fake.metadata[-1]
    assert md[reqctx.KEY_NAME_KEY] == "svc-carol" and reqctx.PROBE_KEY not in md


def test_access_log_names_the_key_never_the_key(stack):
    key, _ = stack.store.create("svc-dave")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter("gateway"))
    access = logging.getLogger("specmesh.access")
    access.addHandler(handler)
    old = access.level
    access.setLevel(logging.INFO)
    try:
        resp = stack.stub.Generate(req("a secret prompt nobody logs"), timeout=30, metadata=bearer(key))
    finally:
        access.removeHandler(handler)
        access.setLevel(old)
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    mine = [x for x in lines if x.get("request_id") == resp.request_id and x["rpc"].startswith("specmesh.v1.Gateway")]
    assert len(mine) == 1
    line = mine[0]
    assert line["key_name"] == "svc-dave" and line["status"] == "OK" and line["trace_id"]
    assert line["completion_tokens"] == 2 and line["prompt_tokens"] > 0
    assert key not in stream.getvalue() and "secret prompt" not in stream.getvalue()


def test_admin_needs_an_admin_key(stack):
    user, _ = stack.store.create("svc-user")
    ops, _ = stack.store.create("svc-ops", admin=True)
    get = apb.GetSpeculationRequest()
    assert code_of(stack.admin.GetSpeculation, get, timeout=30) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(stack.admin.GetSpeculation, get, timeout=30, metadata=bearer(user)) \
        == grpc.StatusCode.PERMISSION_DENIED
    # an admin key gets through to the coordinator (this fake one serves no Admin: UNIMPLEMENTED there)
    assert code_of(stack.admin.GetSpeculation, get, timeout=30, metadata=bearer(ops)) \
        not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


def test_keys_cli_create_list_revoke(redis_server, capsys, monkeypatch):  # noqa: F811
    from specmesh.cli import main

    monkeypatch.setenv("SPECMESH_REDIS_URL", redis_server.url)
    assert main(["keys", "create", "--name", "cli-key", "--rpm", "3", "--tpm", "500"]) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("smk_")
    store = KeyStore(connect(redis_server.url), "specmesh")
    rec = store.lookup(key)
    assert (rec.name, rec.rpm, rec.tpm) == ("cli-key", 3, 500)
    assert key not in dump(connect(redis_server.url))  # only the hash is stored
    assert main(["keys", "create", "--name", "cli-key"]) == 1  # names are unique among live keys
    capsys.readouterr()
    assert main(["keys", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [k["name"] for k in listed if k["name"] == "cli-key"] == ["cli-key"] and key not in json.dumps(listed)
    assert main(["keys", "revoke", "cli-key"]) == 0
    assert store.lookup(key).revoked
    assert main(["keys", "revoke", "cli-key"]) == 1


def dump(r) -> str:
    """Every key and value in the Redis database, as text."""
    out = []
    for k in r.keys("*"):
        kind = r.type(k)
        value = {"hash": r.hgetall, "string": r.get, "set": r.smembers}.get(kind, lambda _: "")(k)
        out.append(f"{k}={value}")
    return "\n".join(out)
