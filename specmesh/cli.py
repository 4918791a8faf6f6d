"""The `specmesh` command: up, generate, health, fetch-model, bench, and the operations below."""

from __future__ import annotations

import argparse
import json
import os
import sys

# gRPC core's own INFO lines (e.g. every failed TLS handshake) are noise on a command line; the
# command prints the status itself. Set before grpc is first imported; an explicit value wins.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from specmesh.auth.cli import add_client_arguments, call_metadata, client_channel
from specmesh.auth.cli import add_commands as add_ops_commands
from specmesh.bench import add_arguments as add_bench_arguments
from specmesh.deploy_cli import add_commands as add_deploy_commands
from specmesh.deploy_cli import add_up_arguments, up_mesh_kwargs
from specmesh.reliability.cli import add_commands as add_reliability_commands
from specmesh.training.cli import add_commands as add_training_commands

DEFAULT_TARGET = "127.0.0.1:50051"


def _cmd_fetch_model(args) -> int:
    from specmesh.engine.fetch import fetch_model

    for name in args.names or [args.name]:
        print(fetch_model(name, home=args.home, progress=True, force=args.force))
    return 0


def _cmd_up(args) -> int:
    from specmesh.config import ConfigError, load_config
    from specmesh.launcher import Mesh

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"specmesh up: bad config: {exc}", file=sys.stderr)
        return 2
    try:
        mesh = Mesh(cfg, args.config, args.log_dir, **up_mesh_kwargs(args))
        mesh.start(timeout_s=args.start_timeout)
    except (RuntimeError, ValueError) as exc:
        print(f"specmesh up: {exc}", file=sys.stderr)
        return 1
    print(f"specmesh: mesh up; gateway at {', '.join(mesh.gateways)} (Ctrl-C to stop)", file=sys.stderr)
    if mesh.http_urls:
        print(f"specmesh: OpenAI-compatible HTTP at {', '.join(mesh.http_urls)}", file=sys.stderr)
    return mesh.run_until_signal()


def build_request(args):
    from specmesh.v1 import specmesh_pb2 as pb

    req = pb.GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, raw=args.raw, stop=args.stop or [])
    if args.temperature is not None:
        req.sampling.temperature = args.temperature
    if args.top_p is not None:
        req.sampling.top_p = args.top_p
    if args.top_k is not None:
        req.sampling.top_k = args.top_k
    if args.seed is not None:
        req.sampling.seed = args.seed
    if args.method:
        req.speculation.method = args.method
    if args.k is not None:
        req.speculation.num_speculative_tokens = args.k
    if getattr(args, "tree_budget", None) is not None:
        req.speculation.tree_budget = args.tree_budget
    return req


def response_json(resp) -> dict:
    spec = resp.spec
    return {
        "text": resp.text,
        "token_ids": list(resp.token_ids),
        "finish_reason": resp.finish_reason,
        "usage": {"prompt_tokens": resp.usage.prompt_tokens, "completion_tokens": resp.usage.completion_tokens},
        "spec": {
            "method": spec.method,
            "rounds": spec.rounds,
            "drafted_tokens": spec.drafted_tokens,
            "accepted_tokens": spec.accepted_tokens,
            "mean_acceptance_length": spec.mean_acceptance_length,
            "accepted_per_position": list(spec.accepted_per_position),
            "draft_failures": spec.draft_failures,
            "tier_down_rounds": spec.tier_down_rounds,
            "graft_rounds": spec.graft_rounds,
            "graft_tokens": spec.graft_tokens,
            "feature_bytes": spec.feature_bytes,
            "draft_feature_bytes": spec.draft_feature_bytes,
            "arm": spec.arm,
        },
        "request_id": resp.request_id,
    }


def _stream(stub, req, timeout, as_json: bool, metadata=None) -> int:
    from specmesh.v1 import specmesh_pb2 as pb

    final = pb.GenerateResponse()
    for chunk in stub.GenerateStream(req, timeout=timeout, metadata=metadata):
        if not as_json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        final.text += chunk.text
        final.token_ids.extend(chunk.token_ids)
        if chunk.finish_reason:
            final.finish_reason = chunk.finish_reason
            final.usage.CopyFrom(chunk.usage)
            final.spec.CopyFrom(chunk.spec)
            final.request_id = chunk.request_id
    print(json.dumps(response_json(final)) if as_json else "")
    return 0


def _cmd_generate(args) -> int:
    import grpc

    from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

    req = build_request(args)
    with client_channel(args) as channel:
        stub = pb_grpc.GatewayStub(channel)
        try:
            if args.stream:
                return _stream(stub, req, args.timeout, args.json, call_metadata(args))
            resp = stub.Generate(req, timeout=args.timeout, metadata=call_metadata(args))
        except grpc.RpcError as err:
            print(f"{err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    print(json.dumps(response_json(resp)) if args.json else resp.text)
    return 0


def _cmd_health(args) -> int:
    import grpc

    from specmesh.v1 import specmesh_pb2 as pb
    from specmesh.v1 import specmesh_pb2_grpc as pb_grpc

    with client_channel(args) as channel:
        try:
            resp = pb_grpc.GatewayStub(channel).Generate(pb.GenerateRequest(prompt="ping", max_tokens=1),
                                                         timeout=args.timeout, metadata=call_metadata(args))
        except grpc.RpcError as err:
            print(f"unhealthy: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    ok = len(resp.token_ids) == 1
    print("healthy" if ok else "unhealthy: generation returned no token")
    return 0 if ok else 1


def _cmd_bench(args) -> int:
    from specmesh.bench import run

    return run(args)


def _add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help="gateway host:port")
    p.add_argument("--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="no chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--method", help="drafter name (ngram, draft_model, block) or off")
    p.add_argument("--k", type=int, help="speculative tokens per round")
    p.add_argument("--tree-budget", type=int, help="block drafter: draft-tree nodes per round (0 = chain)")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds")
    add_client_arguments(p)


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="specmesh", description=__doc__)
    sub = root.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", help="start gateway, coordinator, draft and target worker as processes")
    p.add_argument("--config")
    p.add_argument("--log-dir", help="write each service's log to DIR/<service>.log")
    p.add_argument("--start-timeout", type=float, default=300.0)
    add_up_arguments(p)
    p.set_defaults(fn=_cmd_up)
    p = sub.add_parser("generate", help="call the gateway")
    _add_generate_args(p)
    p.set_defaults(fn=_cmd_generate)
    p = sub.add_parser("health", help="exit 0 only if the gateway completes a real generation")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--timeout", type=float, default=60.0)
    add_client_arguments(p)
    p.set_defaults(fn=_cmd_health)
    p = sub.add_parser("fetch-model", help="download, verify and convert pinned models (specmesh/manifests)")
    p.add_argument("names", nargs="*", metavar="NAME", help="models to fetch (default: --name)")
    p.add_argument("--name", default="smollm2-135m-instruct")
    p.add_argument("--home", help="cache root (default $SPECMESH_HOME or ~/.cache/specmesh)")
    p.add_argument("--force", action="store_true")
    p.set_defaults(fn=_cmd_fetch_model)
    p = sub.add_parser("bench", help="benchmark the mesh (speculation on/off, HF peers) or, with --micro, "
                                     "the target's verify forward")
    add_bench_arguments(p)
    p.set_defaults(fn=_cmd_bench)
    add_deploy_commands(sub)  # probe, workers, plan, ray
    add_training_commands(sub)  # train-drafter, eval-drafter
    add_ops_commands(sub, DEFAULT_TARGET)  # keys, admin
    add_reliability_commands(sub)  # chaos
    return root


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
