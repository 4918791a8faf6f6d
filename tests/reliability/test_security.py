"""The security checks on the in-process mesh: mTLS on every internal port, admin keys, no prompt
or completion text in any log line or span (captured at DEBUG, stricter than the default), and
every listening socket on loopback, /metrics included."""

from __future__ import annotations

import pytest

from specmesh.reliability import security

pytestmark = pytest.mark.service


def _failed(checks) -> list[str]:
    return [f"{c.check} @ {c.target}: expected {c.expected}, got {c.got}" for c in checks if not c.passed]


def test_internal_ports_refuse_peers_without_the_mesh_certificate(rmesh):
    checks = security.mtls_checks(rmesh)
    assert not _failed(checks)
    assert sum(c.expected == "refused" for c in checks) == 9  # 3 ports x (plaintext, no cert, rogue CA)


def test_admin_needs_an_admin_key(rmesh):
    assert not _failed(security.admin_checks(rmesh))


def test_no_prompt_or_completion_text_in_logs_or_spans(rmesh):
    checks = security.text_checks(rmesh, rmesh.logs, settle_s=0.5)
    assert not _failed(checks)
    assert len(checks) == 3, checks  # the completion was long enough to be looked for


def test_log_text_flag_is_what_puts_text_in_logs(rmesh):
    """The check can fail: with logging.log_text (debug only) the canary does show up."""
    import dataclasses

    servicer = rmesh.gateway_servicer
    old = servicer.cfg
    servicer.cfg = old.replace(logging=dataclasses.replace(old.logging, log_text=True))
    try:
        checks = security.text_checks(rmesh, rmesh.logs, settle_s=0.5)
    finally:
        servicer.cfg = old
    assert not checks[1].passed


def test_every_listening_socket_is_on_loopback(rmesh):
    checks = security.bind_checks(rmesh.pids(), rmesh.logs)
    assert not _failed(checks)
    assert any("/metrics" in c.check for c in checks)
