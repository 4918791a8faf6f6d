"""`specmesh ray up|down|status|scale`: the mesh as Ray actors (see specmesh/ray/mesh.py).

Cluster: --address, else $RAY_ADDRESS, else a local one already running (`ray start --head`),
else `ray up` starts a local head itself (127.0.0.1, no dashboard) and `ray down --stop-cluster`
stops it. Workers register in the registry: --redis URL (or registry.url in the config).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def _json_arg(text: str | None) -> dict:
    if not text:
        return {}
    value = json.loads(text)
    if not isinstance(value, dict) or not all(isinstance(v, (int, float)) for v in value.values()):
        raise ValueError(f"expected a JSON object of numbers, got {text!r}")
    return value


def _ray():
    try:
        import ray
    except ImportError:
        print("specmesh ray: Ray is not installed (pip install 'specmesh[ray]')", file=sys.stderr)
        raise SystemExit(2) from None
    return ray


def _start_local_head(num_cpus: int, resources: dict) -> None:
    from specmesh.registry.local_redis import free_port

    # its own GCS port: Ray's default (6379) is Redis's, often taken by a real Redis
    cmd = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1",
           "--port", str(free_port()), "--num-cpus", str(num_cpus), "--include-dashboard", "false",
           "--disable-usage-stats"]
    if resources:
        cmd += ["--resources", json.dumps(resources)]
    print(f"specmesh ray: starting a local Ray head: {' '.join(cmd)}", file=sys.stderr)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def connect(address: str | None, start_local: bool = False, num_cpus: int = 0, resources: dict | None = None):
    address = address or os.environ.get("RAY_ADDRESS")
    if not address:  # a local cluster: keep it (and this driver) on 127.0.0.1; read when ray is imported
        os.environ.setdefault(LOOPBACK_ENV, "0")
    ray = _ray()
    from specmesh.ray.mesh import NAMESPACE

    kwargs = dict(namespace=NAMESPACE, logging_level="ERROR", log_to_driver=False)
    if address:
        return ray.init(address=address, **kwargs)
    try:
        return ray.init(address="auto", **kwargs)
    except (ConnectionError, RuntimeError):
        if not start_local:
            raise
    _start_local_head(num_cpus or max(os.cpu_count() or 1, 16), resources or {})
    return ray.init(address="auto", **kwargs)


def build_spec(args):
    from specmesh.config import load_config
    from specmesh.ray.env import actor_env
    from specmesh.ray.spec import RayMeshSpec, TierSpec

    cfg = load_config(args.config)
    redis_url = args.redis or cfg.registry.url
    if not redis_url:
        raise ValueError("the Ray mesh needs the registry: pass --redis URL (or set registry.url)")
    config_text = Path(args.config or os.environ.get("SPECMESH_CONFIG") or "").read_text() \
        if (args.config or os.environ.get("SPECMESH_CONFIG")) else ""
    cpus = args.cpus_per_replica
    tiers = {
        "target": TierSpec(args.target_workers, cpus, args.target_gpus, _json_arg(args.target_resources)),
        "draft": TierSpec(args.draft_workers, cpus, args.draft_gpus, _json_arg(args.draft_resources)),
        "coordinator": TierSpec(args.coordinators, cpus),
        "gateway": TierSpec(args.gateways, cpus),
    }
    return RayMeshSpec(redis_url=redis_url, config_text=config_text, env=actor_env(), host=args.host,
                       gateway_port=int(cfg.gateway.listen.rsplit(":", 1)[1]),
                       coordinator_port=int(cfg.coordinator.listen.rsplit(":", 1)[1]),
                       start_timeout_s=args.start_timeout, tiers=tiers)


def _print(replicas: list[dict]) -> None:
    for r in replicas:
        state = "up" if r.get("alive") else "DOWN"
        gpus = f" gpus={r['gpus']}" if r.get("gpus") else ""
        print(f"{r['tier']:<12}{r['index']:>3}  {r.get('address', '-'):<24}{state}{gpus}")


def _cmd_up(args) -> int:
    try:
        spec = build_spec(args)
    except (ValueError, OSError) as exc:
        print(f"specmesh ray up: {exc}", file=sys.stderr)
        return 2
    local_resources = {**_json_arg(args.target_resources), **_json_arg(args.draft_resources)}
    local_resources = {k: v * 8 for k, v in local_resources.items()}
    connect(args.address, start_local=True, resources=local_resources)
    from specmesh.ray import mesh

    _print(mesh.up(spec))
    gw = [r["address"] for r in mesh.status() if r["tier"] == "gateway"]
    print(f"specmesh ray: mesh up; gateway at {', '.join(gw)}", file=sys.stderr)
    return 0


def _cmd_status(args) -> int:
    connect(args.address)
    from specmesh.ray import mesh

    replicas = mesh.status()
    print(json.dumps(replicas, indent=2)) if args.json else _print(replicas)
    return 0 if replicas and all(r.get("alive") for r in replicas) else 1


def _cmd_scale(args) -> int:
    connect(args.address)
    from specmesh.ray import mesh

    _print(mesh.scale(args.tier, args.replicas))
    return 0


def _cmd_down(args) -> int:
    connect(args.address)
    from specmesh.ray import mesh

    n = mesh.down()
    print(f"specmesh ray: stopped {n} replica(s)", file=sys.stderr)
    if args.stop_cluster:
        res = subprocess.run([str(Path(sys.executable).parent / "ray"), "stop"], check=False, capture_output=True,
                             text=True)
        print(f"specmesh ray: `ray stop` exited {res.returncode}", file=sys.stderr)
    return 0


def add_ray_command(sub) -> None:
    p = sub.add_parser("ray", help="run the mesh as Ray actors: up | down | status | scale")
    rsub = p.add_subparsers(dest="ray_command", required=True)
    up = rsub.add_parser("up", help="start every tier as Ray actors (workers register in the registry)")
    up.add_argument("--config")
    up.add_argument("--redis", metavar="URL", help="registry (default: registry.url)")
    up.add_argument("--target-workers", type=int, default=1)
    up.add_argument("--draft-workers", type=int, default=1)
    up.add_argument("--coordinators", type=int, default=1)
    up.add_argument("--gateways", type=int, default=1)
    up.add_argument("--target-gpus", type=float, default=0.0, help="num_gpus per target replica")
    up.add_argument("--draft-gpus", type=float, default=0.0, help="num_gpus per draft replica")
    up.add_argument("--target-resources", help='custom resources per target replica, e.g. \'{"target_gpu": 1}\'')
    up.add_argument("--draft-resources", help='custom resources per draft replica, e.g. \'{"draft_gpu": 1}\'')
    up.add_argument("--cpus-per-replica", type=float, default=1.0)
    up.add_argument("--host", help="listen + advertise host (default: 0.0.0.0 / the node IP)")
    up.add_argument("--start-timeout", type=float, default=300.0)
    up.set_defaults(fn=_cmd_up)
    for name, fn, help_ in (("status", _cmd_status, "replicas, addresses, liveness (exit 1 if any is down)"),
                            ("scale", _cmd_scale, "change a tier's replica count at run time"),
                            ("down", _cmd_down, "stop every replica (workers drain) and the controller")):
        q = rsub.add_parser(name, help=help_)
        q.set_defaults(fn=fn)
    for q in rsub.choices.values():
        q.add_argument("--address", help="Ray address (default $RAY_ADDRESS, else the local cluster)")
    rsub.choices["status"].add_argument("--json", action="store_true")
    rsub.choices["scale"].add_argument("--tier", required=True, choices=("draft", "target"))
    rsub.choices["scale"].add_argument("--replicas", required=True, type=int)
    rsub.choices["down"].add_argument("--stop-cluster", action="store_true", help="also `ray stop` (local cluster)")
