"""Measure the T=0 identity rate of speculative vs AR decoding in a given dtype, on the engine.

`python -m specmesh.bench.numerics --dtype bfloat16 --limit 20 --max-tokens 64 --out docs/numerics.json`

For each prompt: AR = one-position steps (what `--method off` runs), SPEC = n-gram drafts of k
verified in one (k+1)-position forward (what `--method ngram` runs), and BATCH = the same SPEC
with all prompts' rounds padded into one batch (--batch-invariant: those forwards row-exact,
specmesh/engine/rowexact.py, and the prefills unpadded, as the target worker's default does). Every token of every run is compared with AR;
for the first divergence the AR step's float32 logits give the gap logit(AR token) -
logit(other token): a flip with a small gap is a rounding near-tie, a large gap would be a bug.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specmesh.core.ngram import propose_ngram
from specmesh.core.rejection import verify_greedy
from specmesh.engine.kv import batched_step, new_sequence_kv


def _ar(model, prompt: list[int], n: int, row_exact: int = 0) -> tuple[list[int], list[torch.Tensor]]:
    """The mesh's own AR: one-position steps (row-exact ones in the deterministic mode, which pads
    them to a 2-row floor where rowexact installed one)."""
    kv = new_sequence_kv(model, len(prompt) + n)
    out = batched_step(model, [kv], [prompt], logits_rows=[[len(prompt) - 1]])[0]
    kv.commit(len(prompt))
    tokens, logits = [int(out.logits[-1].argmax())], [out.logits[-1]]
    while len(tokens) < n:
        out = batched_step(model, [kv], [[tokens[-1]]], row_exact=row_exact)[0]
        kv.commit(1)
        tokens.append(int(out.logits[-1].argmax()))
        logits.append(out.logits[-1])
    return tokens, logits


def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    """Plain HF greedy `generate` (its own DynamicCache and SDPA): what users run as the target."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _spec(model, prompts: list[list[int]], n: int, k: int, row_exact: int = 0) -> list[list[int]]:
    """Chain speculation with n-gram drafts; all prompts' rounds batched into one forward."""
    kvs, outs = [new_sequence_kv(model, len(p) + n + k + 1) for p in prompts], []
    last = [[len(p) - 1] for p in prompts]
    prefills = ([batched_step(model, [kv], [p], logits_rows=[r])[0] for kv, p, r in zip(kvs, prompts, last)]
                if row_exact else batched_step(model, kvs, prompts, logits_rows=last))
    for kv, p, out in zip(kvs, prompts, prefills):
        kv.commit(len(p))
        outs.append([int(out.logits[-1].argmax())])
    while any(len(o) < n for o in outs):
        live = [b for b, o in enumerate(outs) if len(o) < n]
        drafts = [propose_ngram(prompts[b] + outs[b], min(k, n - len(outs[b]) - 1), 1, 4) if n - len(outs[b]) > 1
                  else [] for b in live]
        steps = batched_step(model, [kvs[b] for b in live], [[outs[b][-1]] + d for b, d in zip(live, drafts)],
                             row_exact=row_exact)
        for b, d, step in zip(live, drafts, steps):
            res = verify_greedy(step.logits, d)
            kvs[b].commit(res.accepted + 1)
            outs[b] += res.tokens
    return [o[:n] for o in outs]


def _first_diff(ref: list[int], got: list[int], logits: list[torch.Tensor]) -> dict | None:
    for i, (a, b) in enumerate(zip(ref, got)):
        if a != b:
            row = logits[i]
            return {"position": i, "ar_token": a, "other_token": b, "gap": float(row[a] - row[b])}
    return None


def measure(model, prompts: list[list[int]], n: int, k: int, row_exact: int = 0, vs_hf: bool = False) -> dict:
    ar = [_ar(model, p, n, row_exact) for p in prompts]
    single = [_spec(model, [p], n, k, row_exact)[0] for p in prompts]
    batched = _spec(model, prompts, n, k, row_exact)
    hf = [hf_generate(model, p, n) for p in prompts] if vs_hf else [None] * len(prompts)
    rows = []
    for i, ((ref, logits), s, b, h) in enumerate(zip(ar, single, batched, hf)):
        rows.append({"prompt": i, "spec_batch1": _first_diff(ref, s, logits),
                     "spec_batched": _first_diff(ref, b, logits)})
        if vs_hf:  # the mesh's AR against plain HF generate, same dtype (gap from the mesh's logits)
            rows[-1]["ar_vs_hf_generate"] = _first_diff(ref, h, logits)
    keys = ("spec_batch1", "spec_batched") + (("ar_vs_hf_generate",) if vs_hf else ())
    identical = {key: sum(r[key] is None for r in rows) for key in keys}
    return {"prompts": len(prompts), "max_tokens": n, "k": k, "batch_invariant": row_exact, "identical": identical,
            "rows": rows}


def main(argv=None) -> int:
    from specmesh.bench.datasets import load_dataset
    from specmesh.engine.fetch import fetch_model
    from specmesh.engine.loader import load_model
    from specmesh.tokenization import PromptEncoder

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model name from specmesh/manifests (default: the default target)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--limit", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-invariant", action="store_true", help="verify row-exact (target_worker.batch_invariant)")
    p.add_argument("--row-floor", type=int, choices=(1, 2), default=1,
                   help="--batch-invariant: 2 = the 2-row floor where probed (batch_invariant auto may pick it)")
    p.add_argument("--no-cpu-kernel", action="store_true", help="torch's own linears (target_worker.cpu_kernel: false)")
    p.add_argument("--attention-fold", choices=("auto", "true", "false"), default="auto",
                   help="one-token rows' attention as grouped rows (target_worker.attention_fold)")
    p.add_argument("--vs-hf", action="store_true", help="also compare the AR with plain HF generate (same dtype)")
    p.add_argument("--dataset", default="mt-bench")
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = fetch_model(args.model, progress=False) if args.model else fetch_model(progress=False)
    model = load_model(model_dir, args.dtype)
    from specmesh.engine import cpu_gemm

    kernel = not args.no_cpu_kernel and cpu_gemm.install(model)  # as the target worker runs it by default
    from specmesh.engine import row_attn

    # bf16 rows on the row kernel as the worker allows it (TargetEngine): mode 2, or batched steps
    row_attn.enable_bf16(model, args.row_floor == 2 if args.batch_invariant else ("auto" if not args.no_cpu_kernel else False))
    if args.batch_invariant:
        from specmesh.engine import rowexact

        rowexact.install(model)
        print(f"probed invariant rows: {rowexact.probed(model, args.row_floor)}")
    from specmesh.engine import attention, exactrow

    attention.configure({"auto": "auto", "true": True, "false": False}[args.attention_fold])
    encoder = PromptEncoder.from_model_dir(model_dir)
    items = load_dataset(args.dataset, limit=args.limit)
    prompts = [encoder.encode(it.prompt, it.messages) for it in items]
    t0 = time.time()
    result = measure(model, prompts, args.max_tokens, args.k, args.row_floor if args.batch_invariant else 0, args.vs_hf)
    result.update(model=model_dir.name, dtype=args.dtype, dataset=args.dataset, cpu_kernel=kernel,
                  row_attn_bf16=bool(getattr(model, "_specmesh_row_attn_bf16", False)),
                  attention_fold=attention.decisions(), attention_exact=exactrow.decisions(), seconds=round(time.time() - t0, 1))
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    for row in result["rows"]:
        for key in ("spec_batch1", "spec_batched", "ar_vs_hf_generate"):
            if row.get(key):
                print(f"prompt {row['prompt']} {key}: flip at {row[key]['position']}, gap {row[key]['gap']:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
