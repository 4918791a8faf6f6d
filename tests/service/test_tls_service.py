"""TLS on the public port and mTLS between services, with certificates the test generates.
A client without a trusted server certificate, or (mTLS) without a valid client certificate, is
refused; the gateway -> coordinator hop runs over mTLS."""

from __future__ import annotations

import grpc
import pytest

from prod_helpers import (FakeCoordinator, Started, gateway_stub, make_config, make_pki, start_fake_coordinator,
                          start_gateway)
from specmesh.rpc import server as rpc_server
from specmesh.telemetry import context as reqctx
from specmesh.v1 import specmesh_pb2 as pb
from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

pytestmark = pytest.mark.service
REQ = pb.GenerateRequest(prompt="hi", max_tokens=2)


def creds(ca=None, cert=None, key=None):
    read = lambda p: p.read_bytes() if p else None  # noqa: E731
    return grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key),
                                        certificate_chain=read(cert))


@pytest.fixture(scope="module")
def tls_mesh(tmp_path_factory, prompt_encoder):
    pytest.importorskip("cryptography")
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    cfg_tls = {"public": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)},
               "mesh": {"cert_file": str(pki.client_cert), "key_file": str(pki.client_key), "ca_file": str(pki.ca)}}
    started = Started()
    try:
        # as every entry point does first: mesh mTLS on for this process's servers and channels
        rpc_server.configure_mesh_tls(make_config({"tls": cfg_tls}).tls.mesh)
        fake = FakeCoordinator(completion=2)
        coordinator = start_fake_coordinator(fake, started)  # mTLS (the default credentials)
        cfg = make_config({"tls": cfg_tls, "gateway": {"coordinator": coordinator}})
        _, gw = start_gateway(cfg, prompt_encoder, started,
                              credentials=rpc_server.public_server_credentials(cfg.tls.public))
        yield pki, gw.listen, coordinator, fake, started
    finally:
        started.stop()
        rpc_server.configure_mesh_tls(None)


def refused(stub):
    with pytest.raises(grpc.RpcError) as exc:
        stub.Generate(REQ, timeout=10)
    return exc.value.code()


def test_public_port_speaks_tls(tls_mesh):
    pki, gateway, _, fake, started = tls_mesh
    ok = gateway_stub(gateway, started, creds(ca=pki.ca))
    assert ok.Generate(REQ, timeout=30).finish_reason == "length"
    assert fake.metadata[-1][reqctx.REQUEST_ID_KEY]  # ... forwarded to the coordinator over mTLS


def test_public_port_refuses_plaintext_and_untrusted_certificates(tls_mesh):
    pki, gateway, _, _, started = tls_mesh
    assert refused(gateway_stub(gateway, started)) == grpc.StatusCode.UNAVAILABLE
    assert refused(gateway_stub(gateway, started, creds(ca=pki.rogue_ca))) == grpc.StatusCode.UNAVAILABLE


def test_mesh_port_requires_a_client_certificate_from_the_mesh_ca(tls_mesh):
    pki, _, coordinator, _, started = tls_mesh

    def stub(c):
        ch = grpc.secure_channel(coordinator, c) if c is not None else grpc.insecure_channel(coordinator)
        started.channels.append(ch)
        return pb_grpc.CoordinatorStub(ch)

    assert refused(stub(None)) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert refused(stub(creds(ca=pki.ca))) == grpc.StatusCode.UNAVAILABLE  # TLS, no client certificate
    assert refused(stub(creds(ca=pki.ca, cert=pki.rogue_cert, key=pki.rogue_key))) == grpc.StatusCode.UNAVAILABLE
    good = stub(creds(ca=pki.ca, cert=pki.client_cert, key=pki.client_key))
    assert good.Generate(REQ, timeout=30).finish_reason == "length"
    # and what the services themselves use: make_channel with the configured mesh credentials
    ch = rpc_server.make_channel(coordinator)
    started.channels.append(ch)
    assert pb_grpc.CoordinatorStub(ch).Generate(REQ, timeout=30).finish_reason == "length"


def test_public_mtls_when_a_client_ca_is_configured(tls_mesh, prompt_encoder):
    pki, _, coordinator, _, started = tls_mesh
    cfg = make_config({"tls": {"public": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key),
                                          "client_ca_file": str(pki.ca)}},
                       "gateway": {"coordinator": coordinator}})
    _, gw = start_gateway(cfg, prompt_encoder, started,
                          credentials=rpc_server.public_server_credentials(cfg.tls.public))
    assert refused(gateway_stub(gw.listen, started, creds(ca=pki.ca))) == grpc.StatusCode.UNAVAILABLE
    ok = gateway_stub(gw.listen, started, creds(ca=pki.ca, cert=pki.client_cert, key=pki.client_key))
    assert ok.Generate(REQ, timeout=30).finish_reason == "length"
