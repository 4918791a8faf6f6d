"""The prompt-lookup ceiling: how fast n-gram speculation could be at concurrency 1, at best.

    python -m specmesh.bench.ceiling --dataset mt-bench --max-tokens 64 \
        --micro docs/bench/ceiling_micro.json --out docs/bench/ngram_ceiling.json

At T = 0 a round's outcome is known without running the mesh: the target's greedy continuation
(HF `generate`, which the mesh's AR equals token for token in float32, docs/bench/engine.md
section 4) decides which drafted tokens would be accepted. So this replays every prompt's
continuation round by round with the mesh's proposer (specmesh.core.ngram, the config's min_n /
max_n) and prices each round with the target's measured forward time for its q positions at
batch 1 (a `specmesh bench --micro --micro-batch 1` result; linear between the measured q). Two
policies:

    oracle   each round drafts exactly the tokens the target will accept (k = the accepted count
             of a k_max-token lookup): no k rule can do better with this proposer
    fixed    k = --k every round (no rule at all)

It also reports a_j (the rate at which draft position j is accepted once j - 1 was) by the length
of the match a lookup drafts from (core/ngram.py MATCH_BUCKETS): the round policy's per-bucket
seeds (core/goodput.py SEEDS) come from such a run.

Output per category: tokens per round and speed over AR (each AR token costs one 1-position
forward), i.e. the forward time alone: hops, sampling and prefill come on top, for AR and
speculation alike. A category whose oracle is below a target ratio cannot reach it with prompt
lookup, whatever the round policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from specmesh.core.costmodel import monotone
from specmesh.core.ngram import MATCH_BUCKETS, lookup_ngram, match_bucket, propose_ngram


def forward_cost(micro: dict, mode: str = "batch_invariant"):
    """cost(q): ms of a batch-1 forward of q positions from a --micro result (chains in `mode`;
    linear between measured q over their monotone fit, as the mesh's cost model reads its
    buckets, extended linearly past the last)."""
    pts = sorted((r["positions"], r["median_ms"]) for r in micro["results"]
                 if r["batch"] == 1 and not r.get("tree") and r.get("mode", "batched") == mode)
    if len(pts) < 2 or pts[0][0] != 1:
        raise ValueError("the --micro result needs batch-1 chains with 1 position and at least one more")
    xs, ys = [p[0] for p in pts], monotone([p[1] for p in pts])
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return lambda q: float(np.interp(q, xs, ys)) if q <= xs[-1] else ys[-1] + slope * (q - xs[-1])


def replay(context: list[int], continuation: list[int], cost, k_max: int, min_n: int, max_n: int,
           fixed: int | None = None) -> tuple[int, int, float]:
    """(tokens, rounds, ms) of decoding `continuation` after `context` (its first token comes from
    the prefill): each round looks up k_max tokens and drafts the accepted ones (fixed=None, the
    oracle) or the first `fixed`."""
    ctx, t, rounds, ms = list(context) + continuation[:1], 1, 0, 0.0
    while t < len(continuation):
        cap = min(k_max, len(continuation) - t - 1)  # a round emits at most what is left
        draft = propose_ngram(ctx, cap, min_n, max_n)[: cap if fixed is None else min(fixed, cap)]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == continuation[t + accepted]:
            accepted += 1
        k = accepted if fixed is None else len(draft)
        ms += cost(k + 1)
        rounds += 1
        ctx += continuation[t:t + accepted + 1]
        t += accepted + 1
    return len(continuation) - 1, rounds, ms


def ceiling(samples: list[dict], cost, k_max: int, min_n: int, max_n: int, fixed: int) -> dict:
    """Per category and overall: tokens per round and speed over AR of the oracle and fixed k."""
    sums: dict[str, dict[str, list[float]]] = {}
    for s in samples:
        for policy, k in (("oracle", None), (f"fixed_k{fixed}", fixed)):
            run = replay(s["prompt_ids"], s["output_ids"], cost, k_max, min_n, max_n, k)
            for cat in (s["category"] or "-", "all"):
                acc = sums.setdefault(cat, {}).setdefault(policy, [0, 0, 0.0])
                for i, x in enumerate(run):
                    acc[i] += x
    return {cat: {p: {"tokens_per_round": t / max(r, 1), "speedup_vs_ar": t * cost(1) / ms if ms else 1.0}
                  for p, (t, r, ms) in by.items()} for cat, by in sums.items()}


def match_rates(samples: list[dict], k_max: int, min_n: int, max_n: int) -> dict[int, dict]:
    """Per match bucket: the continuation positions whose lookup matched that long, and a_1..a_k_max
    over them (every position after the prefill's token, each a fresh lookup of k_max tokens)."""
    tried = {b: np.zeros(k_max) for b in MATCH_BUCKETS}
    hit = {b: np.zeros(k_max) for b in MATCH_BUCKETS}
    count = dict.fromkeys(MATCH_BUCKETS, 0)
    for s in samples:
        cont = s["output_ids"]
        for t in range(1, len(cont)):
            n, draft = lookup_ngram(s["prompt_ids"] + cont[:t], k_max, min_n, max_n)
            if not n:
                continue
            b = match_bucket(n)
            count[b] += 1
            for j, tok in enumerate(draft[:len(cont) - t]):
                tried[b][j] += 1
                if tok != cont[t + j]:
                    break
                hit[b][j] += 1
    return {b: {"positions": count[b],
                "rates": [round(float(h / n), 3) if n else None for h, n in zip(hit[b], tried[b])]}
            for b in MATCH_BUCKETS}


def bucket_label(b: int) -> str:
    """1, 2, 3, 4-7, 8+: the match lengths a bucket holds."""
    later = [x for x in MATCH_BUCKETS if x > b]
    return f"{b}+" if not later else str(b) if later[0] == b + 1 else f"{b}-{later[0] - 1}"


def greedy_samples(cfg, dataset: str, limit: int | None, max_tokens: int, threads: int) -> list[dict]:
    """The target's greedy continuation of every prompt (HF `generate`, tokenized as the gateway)."""
    import torch

    from specmesh.bench.datasets import load_dataset
    from specmesh.bench.peers import HFPeer

    peer = HFPeer(cfg.model, cfg.draft_worker.ngram.max_n, threads)
    out = []
    for p in load_dataset(dataset, limit=limit):
        ids = peer.encoder.encode(p.prompt, [tuple(m) for m in p.messages] if p.messages else None)
        with torch.no_grad():
            y = peer.model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                                    eos_token_id=peer.eos, pad_token_id=peer.eos[0])
        out.append({"prompt_id": p.prompt_id, "category": p.category, "prompt_ids": ids,
                    "output_ids": y[0, len(ids):].tolist()})
        print(f"ceiling: {p.prompt_id} {len(out[-1]['output_ids'])} tokens", file=sys.stderr)
    return out


def cached_samples(cfg, args) -> list[dict]:
    """greedy_samples for args.dataset / limit / max_tokens / threads, read from args.samples (a
    JSONL) when it exists, else generated and written there (when given)."""
    cache = Path(args.samples) if args.samples else None
    if cache is not None and cache.exists():
        return [json.loads(line) for line in cache.read_text().splitlines() if line]
    samples = greedy_samples(cfg, args.dataset, args.limit, args.max_tokens, args.threads)
    if cache is not None:
        cache.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return samples


def markdown(doc: dict) -> str:
    policies = list(doc["ceiling"]["all"])
    lines = [f"## Prompt-lookup ceiling at concurrency 1 ({doc['dataset']}, {doc['prompts']} prompts x "
             f"{doc['max_tokens']} tokens, T=0)", "", f"`{doc['command']}`", "",
             f"{doc['machine'].get('cpu')}; forward ms by positions (batch 1, from the --micro result): "
             + ", ".join(f"{q}: {ms:.1f}" for q, ms in doc["forward_ms"].items()), "",
             "| category | " + " | ".join(f"{p}: tokens/round | {p}: x AR" for p in policies) + " |",
             "| --- |" + " --- | --- |" * len(policies)]
    for cat, by in sorted(doc["ceiling"].items(), key=lambda kv: (kv[0] == "all", kv[0])):
        lines.append(f"| {cat} | " + " | ".join(f"{by[p]['tokens_per_round']:.2f} | {by[p]['speedup_vs_ar']:.2f}x"
                                                for p in policies) + " |")
    lines += ["", f"a_j by the match's length (min_n {doc['min_n']}, max_n {doc['max_n']}; positions with a match):",
              "", "| match | positions | a_1 .. a_k |", "| --- | --- | --- |"]
    for b, m in doc.get("match_rates", {}).items():
        rates = " ".join("-" if x is None else f"{x:.2f}" for x in m["rates"])
        lines.append(f"| {bucket_label(int(b))} | {m['positions']} | {rates} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from specmesh.bench.compare import command_line, machine_info
    from specmesh.config import load_config

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config")
    p.add_argument("--dataset", default="mt-bench")
    p.add_argument("--limit", type=int)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--micro", required=True, help="a `specmesh bench --micro --micro-batch 1` result (JSON)")
    p.add_argument("--micro-mode", default="batch_invariant", choices=("batch_invariant", "batched"),
                   help="the verify mode the mesh runs (target_worker.batch_invariant; auto: the probe's)")
    p.add_argument("--k-max", type=int, default=8, help="the oracle's lookup length (goodput_k_max)")
    p.add_argument("--k", type=int, default=4, help="the fixed policy's k")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--samples", help="a JSONL of greedy continuations: read when it exists, else written")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    cfg = load_config(args.config)
    cost = forward_cost(json.loads(Path(args.micro).read_text()), args.micro_mode)
    ng = cfg.draft_worker.ngram
    samples = cached_samples(cfg, args)
    command = "python -m specmesh.bench.ceiling " + command_line().split(" ", 1)[-1]
    doc = {"command": command, "micro_mode": args.micro_mode, "dataset": args.dataset, "prompts": len(samples),
           "max_tokens": args.max_tokens,
           "k_max": args.k_max, "min_n": ng.min_n, "max_n": ng.max_n, "machine": machine_info(),
           "forward_ms": {q: cost(q) for q in range(1, args.k_max + 2)},
           "ceiling": ceiling(samples, cost, args.k_max, ng.min_n, ng.max_n, args.k),
           "match_rates": match_rates(samples, args.k_max, ng.min_n, ng.max_n)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
