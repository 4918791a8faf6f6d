"""grpc.health.v1 probes of one service, over TLS when the mesh config says the service speaks it.

Who trusts what (the probe is a client like any other):
- internal services (coordinator, draft and target workers) with `tls.mesh`: the probe presents the
  mesh certificate and trusts `tls.mesh.ca_file`, as the services do with each other;
- the gateway with `tls.public`: the probe trusts `tls.public.ca_file` (the CA that signed
  cert_file), else cert_file itself (self-signed, or a full chain); when the public port requires
  client certificates (`client_ca_file`) it presents the mesh certificate, so the launcher's own
  probe works only if the mesh certificate is signed by that CA.
"""

from __future__ import annotations

import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.rpc.client_tls import ClientTls


def probe_tls_for(cfg, service: str) -> ClientTls:
    """cfg: specmesh.config.MeshConfig; service: gateway | coordinator | draft_worker | target_worker."""
    mesh, public = cfg.tls.mesh, cfg.tls.public
    if service == "gateway":
        if public.cert_file is None:
            return ClientTls()
        client = (mesh.cert_file, mesh.key_file) if public.client_ca_file and mesh.cert_file else (None, None)
        return ClientTls(public.ca_file or public.cert_file, client[0], client[1], public.server_name)
    if mesh.cert_file is None:
        return ClientTls()
    return ClientTls(mesh.ca_file, mesh.cert_file, mesh.key_file, mesh.server_name)


def check_serving(address: str, timeout_s: float = 1.0, service: str = "", tls: ClientTls | None = None) -> bool:
    """One grpc.health.v1 Check: True only for SERVING (False on any error, TLS handshake included)."""
    with (tls or ClientTls()).channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=timeout_s)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


def wait_serving(address: str, timeout_s: float, proc: subprocess.Popen | None = None,
                 tls: ClientTls | None = None) -> bool:
    """Poll grpc.health.v1 until SERVING; False on timeout or if proc exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        if check_serving(address, tls=tls):
            return True
        time.sleep(0.2)
    return False
