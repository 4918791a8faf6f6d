"""gRPC server reflection on every service, through grpcio-reflection's own client
(ProtoReflectionDescriptorDatabase) against real servers: list the services, describe methods,
build a request from the reflected descriptors alone and send it. Reflection shares the port and
its credentials: behind mTLS it needs a client certificate, and it opens no method that needs an
API key."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import json_format, message_factory
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from prod_helpers import (FakeCoordinator, Started, bearer, make_config, make_pki, redis_server,  # noqa: F401
                          start_fake_coordinator, start_gateway, start_mesh)
from specmesh.rpc import server as rpc_server
from specmesh.v1 import specmesh_pb2 as pb

pytestmark = pytest.mark.service
BUILTIN = {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
EXPECTED = {"gateway": {"specmesh.v1.Gateway", "specmesh.v1.Admin"},
            "coordinator": {"specmesh.v1.Coordinator", "specmesh.v1.Admin"},
            "draft_worker": {"specmesh.v1.DraftWorker"},
            "target_worker": {"specmesh.v1.TargetWorker"}}


class Reflected:
    """What a client that has only the server (no generated stubs) can do with reflection."""

    def __init__(self, channel: grpc.Channel):
        self.channel = channel
        self.db = ProtoReflectionDescriptorDatabase(channel)
        self.pool = DescriptorPool(self.db)

    def services(self) -> set[str]:
        return set(self.db.get_services())

    def method(self, service: str, name: str):
        return self.pool.FindServiceByName(service).methods_by_name[name]

    def call(self, service: str, name: str, fields: dict, **kwargs):
        """Unary call with request / response classes made from the reflected descriptors."""
        m = self.method(service, name)
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        request = json_format.ParseDict(fields, req_cls())
        rpc = self.channel.unary_unary(f"/{service}/{name}", request_serializer=req_cls.SerializeToString,
                                       response_deserializer=resp_cls.FromString)
        return rpc(request, **kwargs)


@pytest.fixture(scope="module")
def mesh(target_model, prompt_encoder):
    m = start_mesh(target_model, prompt_encoder)  # the four services wired as their entry points wire them
    yield m
    m.stop()


def reflected(started: Started, address: str, credentials=None) -> Reflected:
    channel = grpc.secure_channel(address, credentials) if credentials is not None else grpc.insecure_channel(address)
    started.channels.append(channel)
    return Reflected(channel)


def test_every_service_lists_what_it_serves(mesh):
    for role, expected in EXPECTED.items():
        svc = mesh.services[role]
        listed = reflected(mesh.started, svc.listen).services()
        assert listed == expected | BUILTIN, role
        assert set(svc.services) == listed, role


def test_describe_every_method_of_every_service(mesh):
    for role, expected in EXPECTED.items():
        r = reflected(mesh.started, mesh.services[role].listen)
        for service in expected:
            methods = r.pool.FindServiceByName(service).methods
            assert methods, service
            for m in methods:  # each resolves to full message descriptors (grpcurl describe)
                assert m.input_type.fields is not None and m.output_type.full_name.startswith("specmesh.v1.")
    gw = reflected(mesh.started, mesh.services["gateway"].listen)
    stream = gw.method("specmesh.v1.Gateway", "GenerateStream")
    assert stream.server_streaming and not stream.client_streaming
    assert stream.input_type.full_name == "specmesh.v1.GenerateRequest"
    assert stream.output_type.full_name == "specmesh.v1.GenerateChunk"
    generate = gw.method("specmesh.v1.Gateway", "Generate")
    assert not generate.server_streaming
    # the reflected message is the compiled one, field for field
    compiled = {f.name: (f.number, f.type) for f in pb.GenerateRequest.DESCRIPTOR.fields}
    assert {f.name: (f.number, f.type) for f in generate.input_type.fields} == compiled


def test_a_request_built_from_reflection_generates(mesh):
    gw = reflected(mesh.started, mesh.services["gateway"].listen)
    resp = gw.call("specmesh.v1.Gateway", "Generate",
                   {"prompt": "Count to five.", "max_tokens": 4, "speculation": {"method": "ngram"}}, timeout=120)
    assert type(resp).DESCRIPTOR.full_name == "specmesh.v1.GenerateResponse"
    assert 1 <= len(resp.token_ids) <= 4 and resp.usage.completion_tokens == len(resp.token_ids)
    assert resp.finish_reason in ("length", "stop")
    target = reflected(mesh.started, mesh.services["target_worker"].listen)
    status = target.call("specmesh.v1.TargetWorker", "Status", {}, timeout=30)
    assert status.vocab_size == mesh.engine.vocab_size > 0 and status.live_sequences == 0
    with pytest.raises(grpc.RpcError) as exc:  # reflection-built requests go through the same validation
        gw.call("specmesh.v1.Gateway", "Generate", {"prompt": "x", "max_tokens": -1}, timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def tls(tmp_path, prompt_encoder):
    """Public TLS on a gateway, mesh mTLS on a coordinator; process-wide mesh TLS is off again after."""
    pytest.importorskip("cryptography")
    pki = make_pki(tmp_path)
    cfg_tls = {"public": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)},
               "mesh": {"cert_file": str(pki.client_cert), "key_file": str(pki.client_key), "ca_file": str(pki.ca)}}
    started = Started()
    try:
        rpc_server.configure_mesh_tls(make_config({"tls": cfg_tls}).tls.mesh)
        coordinator = start_fake_coordinator(FakeCoordinator(completion=2), started)  # mTLS
        cfg = make_config({"tls": cfg_tls, "gateway": {"coordinator": coordinator}})
        _, gw = start_gateway(cfg, prompt_encoder, started,
                              credentials=rpc_server.public_server_credentials(cfg.tls.public))
        yield pki, coordinator, gw.listen, started
    finally:
        started.stop()
        rpc_server.configure_mesh_tls(None)


def creds(ca=None, cert=None, key=None):
    read = lambda p: p.read_bytes() if p else None  # noqa: E731
    return grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key),
                                        certificate_chain=read(cert))


def refused(r: Reflected) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as exc:
        r.services()
    return exc.value.code()


def test_reflection_behind_mtls_needs_a_mesh_client_certificate(tls):
    pki, coordinator, _, started = tls
    assert refused(reflected(started, coordinator)) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert refused(reflected(started, coordinator, creds(ca=pki.ca))) == grpc.StatusCode.UNAVAILABLE  # no cert
    rogue = creds(ca=pki.ca, cert=pki.rogue_cert, key=pki.rogue_key)
    assert refused(reflected(started, coordinator, rogue)) == grpc.StatusCode.UNAVAILABLE
    good = reflected(started, coordinator, creds(ca=pki.ca, cert=pki.client_cert, key=pki.client_key))
    assert "specmesh.v1.Coordinator" in good.services()


def test_reflection_on_the_tls_public_port(tls):
    pki, _, gateway, started = tls
    assert refused(reflected(started, gateway)) == grpc.StatusCode.UNAVAILABLE
    r = reflected(started, gateway, creds(ca=pki.ca))
    assert r.services() == EXPECTED["gateway"] | BUILTIN
    assert r.call("specmesh.v1.Gateway", "Generate", {"prompt": "hi", "max_tokens": 2}, timeout=30).token_ids


def test_reflection_opens_no_method_that_needs_an_api_key(redis_server, prompt_encoder):  # noqa: F811
    from specmesh.auth.store import KeyStore, connect

    started = Started()
    try:
        coordinator = start_fake_coordinator(FakeCoordinator(completion=2), started)
        cfg = make_config({"auth": {"required": True, "redis_url": redis_server.url, "key_prefix": "reflect"},
                           "gateway": {"coordinator": coordinator}})
        _, gw = start_gateway(cfg, prompt_encoder, started)
        r = reflected(started, gw.listen)
        assert "specmesh.v1.Gateway" in r.services()  # the schema is public (it is protos/ too) ...
        with pytest.raises(grpc.RpcError) as exc:  # ... the methods are not
            r.call("specmesh.v1.Gateway", "Generate", {"prompt": "hi", "max_tokens": 2}, timeout=30)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as exc:
            r.call("specmesh.v1.Admin", "GetSpeculation", {}, timeout=30)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        key, _ = KeyStore(connect(redis_server.url), "reflect").create("reflect-user")
        resp = r.call("specmesh.v1.Gateway", "Generate", {"prompt": "hi", "max_tokens": 2}, timeout=30,
                      metadata=bearer(key))
        assert resp.usage.completion_tokens == 2
    finally:
        started.stop()
