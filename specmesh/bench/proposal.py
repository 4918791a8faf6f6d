"""What a truncated T>0 proposal costs in acceptance and saves on the wire, for a draft/target pair.

`python -m specmesh.bench.proposal --config specmesh/configs/qwen-coder.yaml \
    --dataset mt-bench:coding,writing --limit 16 --max-tokens 64 --top-k 0,16,64,256 --out docs/bench/pair_proposal.json`

At T > 0 a drafted token is accepted with probability min(1, p/q), so a draft position drawn from q
is accepted with probability alpha = sum_x min(p(x), q(x)) (p: the target's distribution there).
The draft worker with `draft_model.proposal_top_k: K` draws from q kept on its K likeliest tokens
and renormalised (lossless: the target receives exactly that q), so the row travels as K
(id, prob) pairs instead of V floats; the price is a smaller alpha wherever q's tail overlapped p.

For each prompt the target samples a continuation (HF `generate`, the request's temperature, a
seeded generator); then one forward of each model over prompt + continuation gives p and q at
every generated position, and alpha is computed for the dense q and for each K. A chain of k
drafts starting at position t accepts on average sum_{i=1..k} prod_{j<i+1} alpha_{t+j-1} (positions
taken along the sampled text). Bytes: the serialized VerifyRequest of a k-token chain with its
probabilities dense (float32 [k, V]) or sparse (SparseProbs), built from the measured rows.
No timing here: the figures do not depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specmesh.core.sampling import truncate
from specmesh.rpc.convert import probs_to_wire
from specmesh.v1 import specmesh_pb2 as pb


def alphas(p: torch.Tensor, q: torch.Tensor, top_k: int) -> torch.Tensor:
    """p, q: [N, V] probabilities -> [N] acceptance probability of a token drawn from truncate(q)."""
    return torch.minimum(p, truncate(q, top_k)).sum(dim=-1)


def chain_accepted(alpha: torch.Tensor, k: int) -> float:
    """alpha: [N] along a text -> mean accepted drafts of a k-chain started at each position."""
    n = alpha.shape[0]
    total = 0.0
    for t in range(n):
        run = 1.0
        for j in range(min(k, n - t)):
            run *= float(alpha[t + j])
            total += run
    return total / max(1, n)


def request_bytes(q: torch.Tensor, tokens: list[int], top_k: int) -> int:
    """Serialized VerifyRequest of a chain drafted from rows q [k, V] (truncated to top_k)."""
    rows = truncate(q, top_k)
    dense, sparse = probs_to_wire(rows)
    msg = pb.VerifyRequest(seq_id="x" * 24, draft_token_ids=tokens, draft_probs=dense, vocab_size=q.shape[-1])
    if sparse is not None:
        msg.draft_sparse_probs.CopyFrom(sparse)
    return msg.ByteSize()


@torch.inference_mode()
def measure_prompt(target, draft, ids: list[int], n: int, temperature: float, seed: int, eos: list[int]):
    """-> (p, q) [N, V] float32 at the N positions the target generated after `ids`."""
    prompt = torch.tensor([ids], dtype=torch.long)
    torch.manual_seed(seed)
    out = target.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                          do_sample=True, temperature=temperature, top_p=1.0, top_k=0,
                          eos_token_id=eos, pad_token_id=eos[0] if eos else 0)
    full = out[:, :-1]  # [1, L + N - 1]: position L - 1 + i predicts generated token i
    start = len(ids) - 1
    p = torch.softmax(target(full).logits[0, start:].float() / temperature, dim=-1)  # [N, V]
    q = torch.softmax(draft(full).logits[0, start:].float() / temperature, dim=-1)  # [N, V]
    vocab = min(p.shape[-1], q.shape[-1])  # padded embedding rows past the tokenizer's vocabulary
    return p[:, :vocab], q[:, :vocab]


def run(args) -> dict:
    from specmesh.bench.datasets import load_dataset
    from specmesh.bench.peers import HFPeer
    from specmesh.config import load_config

    cfg = load_config(args.config)
    torch.set_num_threads(args.threads)
    peer = HFPeer(cfg.model, draft_cfg=cfg.draft_worker.draft_model)
    draft = peer.draft()
    top_ks = [int(x) for x in args.top_k.split(",")]
    per_k = {k: [] for k in top_ks}
    bytes_k = {k: [] for k in top_ks}
    started = time.time()
    for i, prompt in enumerate(load_dataset(args.dataset, limit=args.limit)):
        p, q = measure_prompt(peer.model, draft, peer.encode(prompt), args.max_tokens, args.temperature,
                              args.seed + i, peer.eos)
        for k in top_ks:
            per_k[k].append(alphas(p, q, k))
            tokens = [int(t) for t in truncate(q[: args.chain], k).argmax(dim=-1)]
            bytes_k[k].append(request_bytes(q[: args.chain], tokens, k))
        print(f"prompt {i}: {p.shape[0]} positions, dense alpha {float(per_k[top_ks[0]][-1].mean()):.3f}", flush=True)
    rows = []
    for k in top_ks:
        alpha = torch.cat(per_k[k])
        rows.append({"top_k": k, "positions": int(alpha.shape[0]), "alpha": float(alpha.mean()),
                     "chain_accepted": sum(chain_accepted(a, args.chain) for a in per_k[k]) / len(per_k[k]),
                     "request_bytes": sum(bytes_k[k]) / len(bytes_k[k])})
    return {"command": args.command, "temperature": args.temperature, "chain": args.chain,
            "prompts": len(per_k[top_ks[0]]), "max_tokens": args.max_tokens, "rows": rows,
            "minutes": round((time.time() - started) / 60, 1)}


def table(result: dict) -> str:
    lines = [f"`{result['command']}`", "",
             f"T={result['temperature']}, {result['prompts']} prompts x {result['max_tokens']} sampled tokens, "
             f"chains of {result['chain']}", "",
             "| proposal | alpha (per-position acceptance) | accepted per chain | VerifyRequest bytes |",
             "| --- | --- | --- | --- |"]
    for r in result["rows"]:
        name = "dense" if r["top_k"] <= 0 else f"top-{r['top_k']}, sparse"
        lines.append(f"| {name} | {r['alpha']:.3f} | {r['chain_accepted']:.2f} | {r['request_bytes']:,.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    import sys

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="a config whose draft_worker.draft_model names the draft")
    ap.add_argument("--dataset", default="mt-bench:coding,writing")
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", default="0,16,64,256", help="proposal truncations to compare (0: dense)")
    ap.add_argument("--chain", type=int, default=4, help="drafts per round for the chain figures")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="JSON result; the markdown table goes next to it (.md)")
    args = ap.parse_args(argv)
    args.command = "python -m specmesh.bench.proposal " + " ".join(sys.argv[1:] if argv is None else argv)
    result = run(args)
    print(table(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        with open(args.out.rsplit(".", 1)[0] + ".md", "w") as f:
            f.write("## Truncated T>0 proposals: acceptance and bytes\n\n" + table(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
