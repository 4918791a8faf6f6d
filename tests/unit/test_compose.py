"""compose/: the docker-compose files parsed with PyYAML and checked against the code they run
(no Docker engine needed): services, images/builds, commands, env var names, ports, health checks,
restart policies, the collector config, Prometheus' scrape targets, Grafana's provisioning and the
GPU override. The dashboard's queries: tests/unit/test_dashboard.py."""

from __future__ import annotations

import importlib.util
import json
import socket
import tomllib
from pathlib import Path

import pytest
import yaml

from specmesh.config import load_config
from specmesh.envvars import ENV_VARS, known

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose"
SPECMESH_SERVICES = {"gateway": 50051, "coordinator": 50052, "draft-worker": 50053, "target-worker": 50054}
ROLES = {"gateway": "gateway", "coordinator": "coordinator", "draft-worker": "draft_worker",
         "target-worker": "target_worker"}
OBSERVABILITY = {"prometheus": "9090:9090", "grafana": "3000:3000"}
MODULES = {"gateway": "gateway.server", "coordinator": "coordinator.server", "draft-worker": "draft_worker.server",
           "target-worker": "target_worker.server"}


@pytest.fixture(scope="module")
def stack() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def gpu() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.gpu.yml").read_text())


def console_scripts() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]


def test_every_service_is_there(stack):
    assert set(stack["services"]) >= {"redis", "otel-collector", "jaeger", *OBSERVABILITY, *SPECMESH_SERVICES}


def test_specmesh_services_build_the_repo_image(stack):
    for name in SPECMESH_SERVICES:
        svc = stack["services"][name]
        assert svc["image"] == "specmesh:cpu"
        build = svc["build"]
        assert (COMPOSE / build["context"]).resolve() == REPO
        assert (REPO / build["dockerfile"]).is_file()
    for name in ("redis", "otel-collector", "jaeger", *OBSERVABILITY):
        image = stack["services"][name]["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image tag"


def test_dockerfile_generates_stubs_fetches_and_verifies_the_model():
    text = (COMPOSE / "Dockerfile").read_text()
    assert "grpc_tools.protoc" in text and "protos/specmesh/v1" in text
    assert "specmesh fetch-model" in text and "check_model_dir" in text and "require_manifest=True" in text
    assert "download.pytorch.org/whl/cpu" in text
    for line in text.splitlines():
        if line.startswith("COPY "):
            src = line.split()[1]
            assert (REPO / src).exists(), f"Dockerfile copies missing {src}"


def test_commands_are_real_entrypoints_listening_on_their_port(stack):
    for name, port in SPECMESH_SERVICES.items():
        cmd = stack["services"][name]["command"]
        assert cmd[:3] == ["python", "-m", MODULES[name]], cmd
        spec = importlib.util.find_spec(MODULES[name])
        assert spec is not None and "def main(" in Path(spec.origin).read_text()
        assert cmd[3:] == ["--listen", f"0.0.0.0:{port}"]


def test_health_checks_probe_grpc_health_with_the_specmesh_cli(stack):
    from specmesh.cli import parser

    assert "specmesh" in console_scripts()
    for name, port in SPECMESH_SERVICES.items():
        hc = stack["services"][name]["healthcheck"]
        assert hc["test"][:3] == ["CMD", "specmesh", "probe"], hc
        args = parser().parse_args(hc["test"][2:])
        assert args.address == f"127.0.0.1:{port}"
        assert hc["start_period"] and hc["retries"] >= 1
    assert stack["services"]["redis"]["healthcheck"]["test"][:2] == ["CMD", "redis-cli"]


def test_restart_policies(stack):
    for name, svc in stack["services"].items():
        assert svc.get("restart") in ("unless-stopped", "always", "on-failure"), name


def test_only_the_gateway_and_the_uis_publish_host_ports(stack):
    # workers have no fixed host port, so `--scale draft-worker=3 --scale target-worker=2` works
    for name in ("draft-worker", "target-worker", "coordinator"):
        svc = stack["services"][name]
        assert "ports" not in svc, name
        assert str(SPECMESH_SERVICES[name]) in [str(p) for p in svc["expose"]]
        assert "container_name" not in svc and "hostname" not in svc
    assert stack["services"]["gateway"]["ports"] == ["50051:50051"]
    assert any(p.startswith("16686:") for p in stack["services"]["jaeger"]["ports"])
    for name, mapping in OBSERVABILITY.items():
        assert stack["services"][name]["ports"] == [mapping]


def mounts(svc: dict) -> dict[str, Path]:
    """container path -> host path of a service's bind mounts (relative to compose/)."""
    out = {}
    for volume in svc.get("volumes", []):
        src, dest = volume.split(":")[:2]
        out[dest] = (COMPOSE / src).resolve()
    return out


def scrape_jobs() -> dict[str, tuple[list[str], int]]:
    cfg = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    jobs = {}
    for job in cfg["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            assert sd["type"] == "A"
            jobs[job["job_name"]] = (sd["names"], sd["port"])
    return jobs


def test_prometheus_scrapes_every_service_on_its_metrics_port(stack):
    prom = stack["services"]["prometheus"]
    config_path = next(a.split("=", 1)[1] for a in prom["command"] if a.startswith("--config.file="))
    assert mounts(prom)[config_path] == (COMPOSE / "prometheus.yml").resolve()
    jobs = scrape_jobs()
    for name, role in ROLES.items():
        env = {k: str(v) for k, v in stack["services"][name]["environment"].items()}
        cfg = load_config(environ=env)
        port = getattr(cfg.metrics, f"{role}_port")
        assert cfg.metrics.host == "0.0.0.0" and port > 0, f"{name}: /metrics off or on loopback only"
        assert port != SPECMESH_SERVICES[name]
        # the job named after the service scrapes every replica (Docker DNS) on the port it serves
        assert jobs[name] == ([name], port), f"{name}: prometheus.yml scrapes {jobs.get(name)}, the service serves {port}"
        assert str(port) in [str(p).split()[0] for p in stack["services"][name]["expose"]]
    for job, (names, _) in jobs.items():
        assert all(n in stack["services"] for n in names), f"job {job} scrapes unknown services {names}"
    assert set(jobs) == set(ROLES)


def test_grafana_provisions_prometheus_and_the_dashboard(stack):
    grafana = stack["services"]["grafana"]
    m = mounts(grafana)
    provisioning = m["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    host, port = source["url"].removeprefix("http://").split(":")
    assert host == "prometheus" and f"{port}:{port}" in stack["services"]["prometheus"]["ports"]
    assert source["type"] == "prometheus" and source["uid"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "specmesh.yml").read_text())["providers"]
    dashboards = m[provider["options"]["path"]]
    assert (dashboards / "specmesh.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (m[str(Path(home).parent)] / Path(home).name).is_file()
    assert "prometheus" in grafana["depends_on"]
    dashboard = json.loads((dashboards / "specmesh.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    for p in panels:  # every panel and query uses the provisioned datasource
        assert p["datasource"]["uid"] == source["uid"], p["title"]
        assert all(t["datasource"]["uid"] == source["uid"] for t in p["targets"]), p["title"]


def test_env_names_are_read_by_the_code(stack):
    from specmesh.config import load_config

    for name in SPECMESH_SERVICES:
        env = {k: str(v) for k, v in stack["services"][name]["environment"].items()}
        unknown = [k for k in env if not known(k)]
        assert not unknown, f"{name}: env var(s) the code never reads: {unknown}"
        cfg = load_config(environ=env)  # every override parses and validates
        assert cfg.registry.url == "redis://redis:6379/0"


def test_env_var_constants_are_really_read_somewhere():
    sources = [p for d in ("specmesh", "gateway", "coordinator", "draft_worker", "target_worker")
               for p in (REPO / d).rglob("*.py") if p.name != "envvars.py"]
    text = "\n".join(p.read_text(errors="replace") for p in sources)
    import opentelemetry.sdk.environment_variables as otel_env

    otel_names = set(dir(otel_env))
    for name in ENV_VARS:
        assert name in text or name in otel_names, f"{name} is listed in specmesh/envvars.py but read nowhere"


def test_addresses_between_services_resolve_to_services(stack):
    services = stack["services"]
    gw_env = services["gateway"]["environment"]
    host, port = gw_env["SPECMESH_GATEWAY__COORDINATOR"].split(":")
    assert host in services and int(port) == SPECMESH_SERVICES[host]
    endpoint = services["coordinator"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert endpoint == "http://otel-collector:4317"
    redis_host = services["coordinator"]["environment"]["SPECMESH_REGISTRY__URL"].split("//")[1].split(":")[0]
    assert redis_host in services


def test_workers_advertise_their_container_hostname(stack):
    from specmesh.registry.worker import advertise_address

    for name in ("draft-worker", "target-worker"):
        assert "SPECMESH_REGISTRY__ADVERTISE_HOST" not in stack["services"][name]["environment"]
        listen = stack["services"][name]["command"][-1]
        port = int(listen.rsplit(":", 1)[1])
        assert advertise_address(listen, port) == f"{socket.gethostname()}:{port}"


def test_collector_config_receives_otlp_and_exports_to_jaeger(stack):
    volume = stack["services"]["otel-collector"]["volumes"][0]
    src, dest = volume.split(":")[:2]
    cfg = yaml.safe_load((COMPOSE / src).read_text())
    assert dest in stack["services"]["otel-collector"]["command"][0]
    assert cfg["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].endswith(":4317")
    exporters = cfg["service"]["pipelines"]["traces"]["exporters"]
    jaeger = [e for e in exporters if e.startswith("otlp")]
    assert jaeger and cfg["exporters"][jaeger[0]]["endpoint"].split(":")[0] == "jaeger"
    assert stack["services"]["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"


def test_gpu_override_puts_the_worker_tiers_on_different_gpus(gpu, stack):
    ids = {}
    for name in ("target-worker", "draft-worker"):
        assert name in stack["services"]
        (device,) = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        ids[name] = device["device_ids"]
        assert gpu["services"][name]["build"]["args"]["TORCH_INDEX_URL"].startswith("https://")
        device_env = gpu["services"][name]["environment"]["SPECMESH_MODEL__DEVICE"]
        assert load_config(environ={"SPECMESH_MODEL__DEVICE": device_env}).model.device == "cuda"
    assert ids["target-worker"] != ids["draft-worker"]
    assert set(gpu["services"]) == {"target-worker", "draft-worker"}
