"""`specmesh` subcommands for deployment: the `up` scaling flags, probe, workers, plan, ray."""

from __future__ import annotations

import argparse
import json
import sys


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scaling (docs/deployment.md)")
    g.add_argument("--target-workers", type=int, default=1, metavar="M", help="target worker processes")
    g.add_argument("--draft-workers", type=int, default=1, metavar="N", help="draft worker processes (0: target alone)")
    g.add_argument("--coordinators", type=int, default=1, metavar="C", help="coordinator processes")
    g.add_argument("--gateways", type=int, default=1, metavar="G",
                   help="gateway processes; each needs its own port: the first listens on gateway.listen, "
                        "the others on the next free ports (printed at start)")
    g.add_argument("--redis", metavar="URL",
                   help="use the worker registry at URL (workers register, coordinators watch; a worker started "
                        "later joins); 'local' starts a redis-server for the mesh. Default: registry.url, else "
                        "static addresses")
    g.add_argument("--free-ports", action="store_true", help="extra replicas on OS-chosen free ports")


def up_mesh_kwargs(args) -> dict:
    from specmesh.launcher import Scale

    counts = (args.target_workers, args.coordinators, args.gateways)
    if min(counts) < 1 or args.draft_workers < 0:
        raise ValueError("--target-workers, --coordinators and --gateways must be >= 1, --draft-workers >= 0")
    scale = Scale(target_workers=args.target_workers, draft_workers=args.draft_workers,
                  coordinators=args.coordinators, gateways=args.gateways)
    return {"scale": scale, "redis_url": args.redis, "free_ports": args.free_ports}


def _cmd_probe(args) -> int:
    from specmesh.health_probe import check_serving, probe_tls_for
    from specmesh.rpc.client_tls import ClientTls

    tls = ClientTls()
    if args.role:
        from specmesh.config import load_config

        tls = probe_tls_for(load_config(args.config), args.role)
    ok = check_serving(args.address, args.timeout, args.service, tls=tls)
    print(f"{args.address}: {'SERVING' if ok else 'NOT SERVING'}", file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def _cmd_workers(args) -> int:
    from specmesh.config import load_config
    from specmesh.registry import Registry, RegistryError

    cfg = load_config(args.config)
    url = args.redis or cfg.registry.url
    if not url:
        print("specmesh workers: no registry (pass --redis URL or set registry.url)", file=sys.stderr)
        return 2
    reg = Registry(url, cfg.registry.namespace, cfg.registry.ttl_s)
    try:
        listing = {tier: [json.loads(r.to_json()) for r in records] for tier, records in reg.all().items()}
    except RegistryError as exc:
        print(f"UNAVAILABLE: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(listing, indent=2))
    return 0


def _cmd_plan(args) -> int:
    from specmesh.capacity import plan_from_args

    try:
        report = plan_from_args(args)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"specmesh plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("probe", help="exit 0 only if the gRPC server at --address reports SERVING (grpc.health.v1)")
    p.add_argument("--address", required=True, help="host:port")
    p.add_argument("--service", default="", help="health service name ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--role", choices=["gateway", "coordinator", "draft_worker", "target_worker"],
                   help="probe over the TLS this service speaks per the config (tls.public / tls.mesh); "
                        "default: plaintext")
    p.add_argument("--config", help="mesh config YAML for --role (default $SPECMESH_CONFIG, then the shipped one)")
    p.set_defaults(fn=_cmd_probe)

    p = sub.add_parser("workers", help="list the workers registered in the registry (JSON)")
    p.add_argument("--config")
    p.add_argument("--redis", metavar="URL")
    p.set_defaults(fn=_cmd_workers)

    p = sub.add_parser("plan", help="memory per tier for a model, concurrency and context (docs/capacity.md)")
    p.add_argument("--model", required=True, help="a model dir (with config.json), a config.json, or a pinned name")
    p.add_argument("--concurrency", type=int, required=True, help="live sequences per target worker")
    p.add_argument("--context", type=int, required=True, help="tokens per sequence (prompt + output)")
    p.add_argument("--k", type=int, default=4, help="speculative tokens per round")
    p.add_argument("--draft-model", help="draft model dir/config/name (default: none, n-gram drafting)")
    p.add_argument("--draft-weights", default="model", choices=("model", "int8"),
                   help="draft_worker.draft_model.weights: int8 adds an int8 copy of the draft's weights")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=_cmd_plan)

    from specmesh.ray.cli import add_ray_command

    add_ray_command(sub)
