"""`specmesh bench --micro`: the target's verify forward alone, no grpc, no batcher.

Times one specmesh.engine.kv.batched_step on the configured model with every sequence's KV
prefilled to --micro-context tokens, for Q new positions per sequence (Q = k + 1 when verifying
k drafts: the pending token plus the drafts) and B sequences per forward. Reports the median
of --micro-repeats timed forwards (after one untimed warm-up) as ms per forward and as
positions/s = B*Q / time: where positions/s stops growing with Q is where a larger k stops
being free, and the B columns show how that moves under load. Each cell is timed in both verify
modes of the target worker: `batched` (one GEMM over all B*Q rows) and `batch_invariant` (every
row with one-token kernels, target_worker.batch_invariant; specmesh/engine/rowexact.py), whose
ratio is the price of bitwise-stable output.
"""

from __future__ import annotations

import time

import torch

from specmesh.bench.metrics import percentile


def _prefill(model, n: int, context: int, gen: torch.Generator, vocab: int, chunk: int = 4) -> list:
    """n sequences of `context` random tokens, their KV filled (a few sequences per forward)."""
    from specmesh.engine.kv import batched_step, new_sequence_kv

    kvs = [new_sequence_kv(model, capacity=context + 64) for _ in range(n)]
    for start in range(0, n, chunk):
        part = kvs[start:start + chunk]
        prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in part]
        for kv, out in zip(part, batched_step(model, part, prompts)):
            kv.append(out.new_keys, out.new_values)
    return kvs


MODES = ("batched", "batch_invariant")


def time_forward(model, kvs: list, positions: int, repeats: int, gen: torch.Generator, vocab: int,
                 row_exact: bool = False) -> list[float]:
    """Seconds of each of `repeats` forwards of `positions` new tokens per sequence."""
    from specmesh.engine.kv import batched_step

    inputs = [torch.randint(0, vocab, (positions,), generator=gen).tolist() for _ in kvs]
    batched_step(model, kvs, inputs, row_exact=row_exact)  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        batched_step(model, kvs, inputs, row_exact=row_exact)
        times.append(time.perf_counter() - t0)
    return times


def run_micro(model, context: int = 256, positions=(1, 2, 4, 8, 16), batches=(1, 4, 16), repeats: int = 5,
              seed: int = 0, progress=None, modes=MODES) -> list[dict]:
    from specmesh.engine import rowexact

    if "batch_invariant" in modes:
        rowexact.install(model)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    kvs = _prefill(model, max(batches), context, gen, vocab)
    rows = []
    for b in batches:
        for q in positions:
            for mode in modes:
                times = time_forward(model, kvs[:b], q, repeats, gen, vocab, row_exact=mode == "batch_invariant")
                med = percentile(times, 50)
                rows.append({"mode": mode, "batch": b, "positions": q, "context": context, "median_ms": med * 1e3,
                             "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3,
                             "positions_per_s": b * q / med, "repeats": repeats})
                if progress is not None:
                    progress.update(1)
    return rows


def micro_markdown(doc: dict) -> str:
    rows = doc["results"]
    batches = sorted({r["batch"] for r in rows})
    positions = sorted({r["positions"] for r in rows})
    modes = [m for m in MODES if any(r.get("mode", "batched") == m for r in rows)]
    cell = {(r.get("mode", "batched"), r["batch"], r["positions"]): r for r in rows}
    m = doc["machine"]
    lines = [f"## specmesh bench --micro: one verify forward (batched_step), context {doc['context']} tokens",
             "", f"`{doc['command']}`", "",
             f"{m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')} ({m.get('torch_threads')} threads), "
             f"{doc['model']} ({doc.get('dtype', '?')}), {m.get('date')}", "",
             "Median ms per forward (positions/s) — positions Q = k + 1 to verify k drafts", ""]
    for mode in modes:
        lines += [f"**{mode}**", "", "| positions Q | " + " | ".join(f"batch {b}" for b in batches) + " |",
                  "|---|" + "---|" * len(batches)]
        for q in positions:
            cells = [f"{c['median_ms']:.1f} ({c['positions_per_s']:.0f}/s)" if (c := cell.get((mode, b, q))) else "-"
                     for b in batches]
            lines.append(f"| {q} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(args) -> int:
    import json
    import sys
    from pathlib import Path

    from tqdm import tqdm

    from specmesh.bench.compare import command_line, machine_info
    from specmesh.config import load_config
    from specmesh.engine.loader import dtype_name, load_configured_model

    cfg = load_config(args.config)
    threads = args.threads or cfg.runtime.torch_threads
    if threads:
        torch.set_num_threads(threads)
    model_dir, model = load_configured_model(cfg.model.name, cfg.model.path, cfg.model.dtype,
                                             cfg.model.require_manifest, cfg.model.device)
    positions = [int(x) for x in args.micro_positions.split(",") if x]
    batches = [int(x) for x in args.micro_batch.split(",") if x]
    with tqdm(total=len(positions) * len(batches) * len(MODES), file=sys.stderr, disable=args.no_progress) as bar:
        rows = run_micro(model, args.micro_context, positions, batches, args.micro_repeats, args.seed, bar)
    doc = {"command": command_line(), "model": str(model_dir), "dtype": dtype_name(next(model.parameters()).dtype),
           "device": str(next(model.parameters()).device),
           "context": args.micro_context, "results": rows, "machine": machine_info()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    md = micro_markdown(doc)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0
