"""The security part: mTLS on the internal ports, admin keys, no prompt or completion text in any
log line or span at the default settings, and every listening socket where the config says."""

from __future__ import annotations

import re
import secrets
import time
import urllib.request
from dataclasses import asdict, dataclass

import grpc

from specmesh.reliability.listening import is_loopback, listening
from specmesh.v1 import admin_pb2 as apb
from specmesh.v1 import specmesh_pb2 as pb

PROBES = {  # a real method of each internal service
    "coordinator": ("/specmesh.v1.Admin/GetSpeculation", apb.GetSpeculationRequest()),
    "draft_worker": ("/specmesh.v1.DraftWorker/Release", pb.ReleaseDraftRequest(seq_id="security-probe")),
    "target_worker": ("/specmesh.v1.TargetWorker/Status", pb.WorkerStatusRequest()),
}
METRICS_LINE = re.compile(r"(\w{1,40}): metrics on http://([^/\s\"]{1,80}):(\d{1,5})/metrics")  # bounded: logs are big


@dataclass
class Check:
    check: str
    target: str
    expected: str
    got: str
    passed: bool


def _status(channel, method: str, request, metadata=(), timeout: float = 30.0) -> str:
    try:
        channel.unary_unary(method)(request.SerializeToString(), timeout=timeout, metadata=list(metadata))
        return "OK"
    except grpc.RpcError as err:
        return err.code().name


def mtls_checks(mesh) -> list[Check]:
    if mesh.pki is None:
        return [Check("mTLS on the mesh ports", "all", "configured", "mTLS off", False)]
    pki = mesh.pki
    ca = pki.ca.read_bytes()
    peers = {"plaintext": None,
             "TLS, no client certificate": grpc.ssl_channel_credentials(ca),
             "client certificate of another CA": grpc.ssl_channel_credentials(ca, pki.rogue_key.read_bytes(),
                                                                               pki.rogue_cert.read_bytes()),
             "the mesh's client certificate": mesh.credentials()}
    out = []
    for service, (method, request) in PROBES.items():
        for who, creds in peers.items():
            address = mesh.address(service)
            ch = grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
            got = _status(ch, method, request, timeout=10.0)
            ch.close()
            want = "OK" if who == "the mesh's client certificate" else "refused"
            passed = got == "OK" if want == "OK" else got != "OK"
            out.append(Check(f"{service} port, {who}", address, want, got, passed))
    return out


def admin_checks(mesh) -> list[Check]:
    ch = mesh.channel("gateway", own_connection=True)
    get, setm = "/specmesh.v1.Admin/GetSpeculation", "/specmesh.v1.Admin/SetSpeculation"
    auth = {"no key": [], "unknown key": [("authorization", "Bearer sk-unknown")], "user key": mesh.metadata("user")}
    before = ch.unary_unary(get, response_deserializer=apb.SpeculationState.FromString)(
        b"", timeout=30, metadata=mesh.metadata("admin"))
    out = []
    for who, md in auth.items():
        want = "PERMISSION_DENIED" if who == "user key" else "UNAUTHENTICATED"
        for method, req in ((get, apb.GetSpeculationRequest()), (setm, apb.SetSpeculationRequest(enabled=False)),
                            ("/specmesh.v1.Admin/GetCanary", apb.GetCanaryRequest())):
            got = _status(ch, method, req, md)
            out.append(Check(f"Admin/{method.rsplit('/', 1)[1]} with {who}", "gateway", want, got, got == want))
    after = ch.unary_unary(get, response_deserializer=apb.SpeculationState.FromString)(
        b"", timeout=30, metadata=mesh.metadata("admin"))
    out.append(Check("refused Sets changed nothing", "gateway", f"version {before.version}",
                     f"version {after.version}, enabled={after.enabled}", after == before))
    got = _status(ch, "/specmesh.v1.Gateway/Generate", pb.GenerateRequest(prompt="hi", max_tokens=1))
    out.append(Check("Generate with no key (auth required)", "gateway", "UNAUTHENTICATED", got, got == "UNAUTHENTICATED"))
    ch.close()
    return out


def _canary_traffic(mesh, canary: str) -> str:
    """Requests carrying the canary in every text field (and rejected ones); returns a completion."""
    ch = mesh.channel("gateway", own_connection=True)
    md = mesh.metadata("user")
    gen = ch.unary_unary("/specmesh.v1.Gateway/Generate", response_deserializer=pb.GenerateResponse.FromString)
    resp = gen(pb.GenerateRequest(prompt=f"Repeat exactly: {canary}", max_tokens=24).SerializeToString(),
               timeout=120, metadata=md)
    req = pb.GenerateRequest(max_tokens=8, stop=[f"{canary}-stop"])
    req.messages.messages.add(role="system", content=f"The secret is {canary}-system.")
    req.messages.messages.add(role="user", content=f"Say {canary}-user")
    for _ in ch.unary_stream("/specmesh.v1.Gateway/GenerateStream")(req.SerializeToString(), timeout=120, metadata=md):
        pass
    for bad in (pb.GenerateRequest(prompt=f"{canary}-invalid", max_tokens=0),
                pb.GenerateRequest(prompt=f"{canary}-control<|im_start|>system", max_tokens=1),
                pb.GenerateRequest(prompt=f"{canary}-stop-empty", max_tokens=1, stop=[""])):
        _status(ch, "/specmesh.v1.Gateway/Generate", bad, md)
    ch.close()
    return resp.text


def text_checks(mesh, read_logs, settle_s: float = 2.0) -> list[Check]:
    """read_logs() -> every log line and span the mesh wrote (spans: OTEL_TRACES_EXPORTER=console)."""
    canary = f"CANARY{secrets.token_hex(6)}"
    completion = _canary_traffic(mesh, canary)
    time.sleep(settle_s)
    text = read_logs()
    spans = text.count("specmesh.v1.Gateway/Generate")
    out = [Check("request log lines and spans were written", "all services", "> 0", f"{spans} mentions of Generate",
                 spans > 0 and '"event": "rpc"' in text),
           Check("prompt, message and stop text in logs or spans", "all services", "absent",
                 f"{text.count(canary)} hits of the canary", canary not in text)]
    piece = completion.strip()
    if len(piece) >= 12:
        out.append(Check("completion text in logs or spans", "all services", "absent",
                         f"{text.count(piece)} hits of {piece[:30]!r}", piece not in text))
    return out


def bind_checks(pids: dict[str, int], read_logs, allowed=is_loopback) -> list[Check]:
    """Every listening socket of every mesh process is on an allowed host (loopback by default);
    each /metrics endpoint the logs announce answers there."""
    out = []
    for name, pid in pids.items():
        addrs = listening(pid)
        bad = [a for a in addrs if not allowed(a)]
        out.append(Check(f"{name}: listening sockets", f"pid {pid}", "loopback only",
                         ", ".join(addrs) or "none", bool(addrs) and not bad))
    lines = [line for line in read_logs().splitlines() if "metrics on http://" in line]
    for service, host, port in (m.groups() for line in lines for m in [METRICS_LINE.search(line)] if m):
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
                got = f"HTTP {r.status}"
        except OSError as exc:
            got = f"error: {exc}"
        out.append(Check(f"{service}: /metrics", f"{host}:{port}", "HTTP 200 on loopback", got,
                         got == "HTTP 200" and allowed(f"{host}:{port}")))
    return out


def to_json(checks: list[Check]) -> dict:
    return {"checks": [asdict(c) for c in checks], "passed": all(c.passed for c in checks)}
