"""`specmesh up` with TLS on the public port and mTLS between the four services, as a user would
start it: the launcher's own health probe speaks the TLS each service speaks, the mesh comes up,
clients need the CA, plaintext is refused on every port, and SIGTERM drains it to exit 0."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "service"))
from prod_pki import make_pki  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tls_up(tmp_path_factory, e2e):
    pytest.importorskip("cryptography")
    if not e2e.model_cached():
        pytest.skip("default model not cached (run `specmesh fetch-model`)")
    tmp = tmp_path_factory.mktemp("tls_up")
    pki = make_pki(tmp)
    tls = {"public": {"cert_file": str(pki.server_cert), "key_file": str(pki.server_key), "ca_file": str(pki.ca)},
           "mesh": {"cert_file": str(pki.client_cert), "key_file": str(pki.client_key), "ca_file": str(pki.ca)}}
    mesh = e2e.start_up_mesh(tmp, tls=tls, shutdown={"grace_s": 5})
    try:
        mesh.wait_started()  # needs the TLS-aware probe: every child is SERVING over (m)TLS
        yield mesh, pki
    finally:
        mesh.terminate()


def test_up_with_tls_serves_clients_that_trust_the_ca(tls_up, e2e):
    mesh, pki = tls_up
    out = e2e.run_cli("generate", "--target", mesh.gateway, "--ca-file", str(pki.ca), "--prompt", "Say hi.",
                      "--max-tokens", "4", "--json", timeout=300)
    assert out.returncode == 0, out.stderr + mesh.logs()
    resp = json.loads(out.stdout)
    assert len(resp["token_ids"]) >= 1 and resp["finish_reason"] in ("length", "eos", "stop")


def test_plaintext_and_untrusted_clients_are_refused(tls_up, e2e):
    mesh, pki = tls_up
    plain = e2e.run_cli("generate", "--target", mesh.gateway, "--prompt", "hi", "--max-tokens", "1",
                        "--timeout", "10")
    assert plain.returncode == 1 and plain.stderr.startswith("UNAVAILABLE"), plain.stderr
    rogue = e2e.run_cli("generate", "--target", mesh.gateway, "--ca-file", str(pki.rogue_ca), "--prompt", "hi",
                        "--max-tokens", "1", "--timeout", "10")
    assert rogue.returncode == 1 and rogue.stderr.startswith("UNAVAILABLE"), rogue.stderr
    for service in ("coordinator", "draft_worker", "target_worker"):  # internal ports: mTLS only
        probe = e2e.run_cli("probe", "--address", mesh.address(service), "--timeout", "3")
        assert probe.returncode == 1, (service, probe.stdout)
        probe = e2e.run_cli("probe", "--address", mesh.address(service), "--role", service,
                            "--config", str(mesh.config_path), "--timeout", "10")
        assert probe.returncode == 0, (service, probe.stderr)


def test_sigterm_drains_the_tls_mesh_to_exit_0(tls_up):
    mesh, _ = tls_up
    t0 = time.monotonic()
    assert mesh.terminate() == 0, mesh.logs()
    assert "after SIGTERM: killed" not in mesh.stderr()
    assert time.monotonic() - t0 < 30
