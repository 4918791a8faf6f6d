"""specmesh.launcher: replica addresses, how children are wired (static lists vs registry), and
when the launcher gives up on the mesh. No process is started (except trivial `sleep`s)."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest

from specmesh.cli import parser
from specmesh.config import load_config
from specmesh.deploy_cli import up_mesh_kwargs
from specmesh.launcher import Child, Mesh, Scale, check_serving, plan_addresses, plan_http, port_free


def cfg(**over):
    base = {"gateway": {"listen": "127.0.0.1:41001", "coordinator": "127.0.0.1:41002"},
            "coordinator": {"listen": "127.0.0.1:41002"}, "draft_worker": {"listen": "127.0.0.1:41003"},
            "target_worker": {"listen": "127.0.0.1:41004"}}
    base.update(over)
    return load_config(environ={}, overrides=base)


def test_one_of_each_uses_the_configured_addresses():
    addrs = plan_addresses(cfg(), Scale())
    assert addrs == {"target_worker": ["127.0.0.1:41004"], "draft_worker": ["127.0.0.1:41003"],
                     "coordinator": ["127.0.0.1:41002"], "gateway": ["127.0.0.1:41001"]}


def test_extra_replicas_take_consecutive_free_ports_after_the_highest():
    with socket.socket() as busy:  # 41005 is taken: skipped
        busy.bind(("127.0.0.1", 41005))
        busy.listen()
        addrs = plan_addresses(cfg(), Scale(target_workers=2, draft_workers=3, gateways=2))
        extra = [int(a.rsplit(":", 1)[1]) for a in
                 addrs["target_worker"][1:] + addrs["draft_worker"][1:] + addrs["gateway"][1:]]
        # ascending after the highest configured port (41004), 41005 skipped; any other port in
        # between may only be skipped if something on this machine holds it right now
        assert len(extra) == 4 and extra == sorted(set(extra)) and extra[0] > 41005
        skipped = set(range(41006, extra[-1])) - set(extra)
        assert all(not port_free("127.0.0.1", p) for p in skipped), skipped
    assert addrs["gateway"][0] == "127.0.0.1:41001"  # the first gateway keeps the public port


def test_each_gateway_replica_gets_its_own_http_front_port():
    assert plan_http(cfg(), 2) == []  # http.listen null: no HTTP front
    c = cfg(http={"listen": "127.0.0.1:41080"})
    mesh = Mesh(c, None, None, env={"PATH": "/bin"}, scale=Scale(gateways=3))
    mesh.addresses = plan_addresses(c, mesh.scale, free_ports=True)
    mesh.http = plan_http(c, 3)
    listens = [mesh._child_env("gateway", i)["SPECMESH_HTTP__LISTEN"] for i in range(3)]
    assert listens[0] == "127.0.0.1:41080" and len(set(listens)) == 3
    assert mesh.http_urls[0] == "http://127.0.0.1:41080/v1"
    assert "SPECMESH_HTTP__LISTEN" not in mesh._child_env("coordinator", 0)


def test_free_ports_and_zero_draft_workers():
    addrs = plan_addresses(cfg(), Scale(target_workers=3, draft_workers=0), free_ports=True)
    assert addrs["draft_worker"] == [] and len(set(addrs["target_worker"])) == 3


def test_static_wiring_passes_lists_and_spreads_gateways_over_coordinators():
    mesh = Mesh(cfg(), None, None, env={"PATH": "/bin"}, scale=Scale(2, 2, 2, 3))
    mesh.addresses = plan_addresses(mesh.cfg, mesh.scale, free_ports=True)
    env = mesh._child_env("coordinator", 1)
    assert env["SPECMESH_COORDINATOR__TARGET_WORKERS"] == "[" + ", ".join(mesh.addresses["target_worker"]) + "]"
    assert env["SPECMESH_COORDINATOR__DRAFT_WORKERS"] == "[" + ", ".join(mesh.addresses["draft_worker"]) + "]"
    coords = mesh.addresses["coordinator"]
    # IPv4 addresses: every gateway over every coordinator (round-robin), a valid gateway config
    gw = [mesh._child_env("gateway", i)["SPECMESH_GATEWAY__COORDINATOR"] for i in range(3)]
    assert gw == [",".join(coords)] * 3
    assert load_config(environ={"SPECMESH_GATEWAY__COORDINATOR": gw[0]}).gateway.coordinator == gw[0]
    loaded = load_config(environ=env)  # the env a coordinator gets is a valid config
    assert loaded.coordinator.target_workers == tuple(mesh.addresses["target_worker"])
    assert "SPECMESH_REGISTRY__URL" not in env


def test_gateways_by_host_name_are_spread_over_coordinators():
    mesh = Mesh(cfg(), None, None, env={"PATH": "/bin"}, scale=Scale(1, 1, 2, 3))
    mesh.addresses = {"coordinator": ["coord-a:1", "coord-b:2"]}
    assert [mesh._child_env("gateway", i)["SPECMESH_GATEWAY__COORDINATOR"] for i in range(3)] == \
        ["coord-a:1", "coord-b:2", "coord-a:1"]


def test_registry_wiring_gives_every_child_the_url():
    mesh = Mesh(cfg(), None, None, env={}, redis_url="redis://127.0.0.1:1/0")
    mesh.addresses = plan_addresses(mesh.cfg, mesh.scale)
    for service in ("target_worker", "draft_worker", "coordinator", "gateway"):
        env = mesh._child_env(service, 0)
        assert env["SPECMESH_REGISTRY__URL"] == "redis://127.0.0.1:1/0"
        assert "SPECMESH_COORDINATOR__TARGET_WORKERS" not in env


def _child(name, service, alive):
    proc = subprocess.Popen(["sleep", "30" if alive else "0"])
    if not alive:
        proc.wait()
    return Child(name, "127.0.0.1:1", proc, None, service)


def test_mesh_survives_dead_replicas_but_not_a_dead_tier():
    mesh = Mesh(cfg(), None, None, env={})
    mesh.children = [_child("target_worker", "target_worker", True), _child("target_worker_1", "target_worker", False),
                     _child("draft_worker", "draft_worker", False), _child("coordinator", "coordinator", True),
                     _child("gateway", "gateway", True)]
    try:
        assert mesh.fatal() is None  # a dead draft tier and a dead extra target: keep serving
        mesh.children[0].proc.kill()
        mesh.children[0].proc.wait()
        assert mesh.fatal() == "no target_worker left"
    finally:
        for c in mesh.children:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()


def test_up_flags():
    args = parser().parse_args(["up", "--draft-workers", "3", "--target-workers", "2", "--coordinators", "2",
                                "--gateways", "2", "--redis", "local", "--free-ports"])
    kw = up_mesh_kwargs(args)
    assert kw["scale"] == Scale(target_workers=2, draft_workers=3, coordinators=2, gateways=2)
    assert kw["redis_url"] == "local" and kw["free_ports"] is True
    with pytest.raises(ValueError):
        up_mesh_kwargs(parser().parse_args(["up", "--target-workers", "0"]))


def test_probe_command_reports_serving_only(capsys):
    from specmesh.cli import main
    from specmesh.registry.local_redis import free_port

    assert main(["probe", "--address", f"127.0.0.1:{free_port()}", "--timeout", "0.5"]) == 1
    assert check_serving(f"127.0.0.1:{free_port()}", 0.3) is False


def _sh_child(name, script):
    return Child(name, "127.0.0.1:1", subprocess.Popen(["sh", "-c", script]), None, name)


def test_stop_waits_the_services_grace_and_reports_a_clean_drain():
    # a child that needs 2 s to drain after SIGTERM, with shutdown.grace_s 1: the launcher waits
    # grace + its margin, so the drain completes and stop() is clean (the old fixed wait killed here
    # whenever the services' grace exceeded it)
    mesh = Mesh(cfg(shutdown={"grace_s": 1}), None, None, env={})
    mesh.children = [_sh_child("gateway", "trap 'sleep 2; exit 0' TERM; while :; do sleep 0.1; done")]
    time.sleep(0.3)  # the trap is installed
    assert mesh.stop() is True
    assert mesh.children[0].proc.returncode == 0


def test_stop_kills_what_outlives_the_grace_and_says_so(capsys):
    mesh = Mesh(cfg(), None, None, env={})
    mesh.children = [_sh_child("gateway", "trap '' TERM; while :; do sleep 0.1; done"),
                     _sh_child("coordinator", "trap 'exit 3' TERM; while :; do sleep 0.1; done")]
    time.sleep(0.3)
    t0 = time.monotonic()
    assert mesh.stop(grace_s=1.0) is False
    assert time.monotonic() - t0 < 5
    err = capsys.readouterr().err
    assert "gateway still running" in err and "coordinator exited with 3" in err


def test_probe_tls_follows_the_config(tmp_path):
    from specmesh.health_probe import probe_tls_for

    files = {n: str(tmp_path / n) for n in ("pub.crt", "pub.key", "ca.crt", "m.crt", "m.key", "pubca.crt")}
    plain = cfg()
    assert not probe_tls_for(plain, "gateway").enabled and not probe_tls_for(plain, "coordinator").enabled
    tls = cfg(tls={"public": {"cert_file": files["pub.crt"], "key_file": files["pub.key"]},
                   "mesh": {"cert_file": files["m.crt"], "key_file": files["m.key"], "ca_file": files["ca.crt"],
                            "server_name": "mesh.local"}})
    gw = probe_tls_for(tls, "gateway")
    assert (gw.root_file, gw.cert_file) == (files["pub.crt"], None)  # trusts its own cert, no client cert
    tw = probe_tls_for(tls, "target_worker")
    assert (tw.root_file, tw.cert_file, tw.key_file, tw.server_name) == (
        files["ca.crt"], files["m.crt"], files["m.key"], "mesh.local")
    mtls_pub = cfg(tls={"public": {"cert_file": files["pub.crt"], "key_file": files["pub.key"],
                                   "ca_file": files["pubca.crt"], "client_ca_file": files["ca.crt"]},
                        "mesh": {"cert_file": files["m.crt"], "key_file": files["m.key"], "ca_file": files["ca.crt"]}})
    gw = probe_tls_for(mtls_pub, "gateway")
    assert (gw.root_file, gw.cert_file) == (files["pubca.crt"], files["m.crt"])  # presents the mesh cert
