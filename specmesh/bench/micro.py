"""`specmesh bench --micro`: the target's verify forward alone, no grpc, no batcher.

Times one specmesh.engine.kv.batched_step on the configured model with every sequence's KV
prefilled to --micro-context tokens, for Q new positions per sequence (Q = k + 1 when verifying
k drafts: the pending token plus the drafts) and B sequences per forward. Reports the median
of --micro-repeats timed forwards (after one untimed warm-up) as ms per forward and as
positions/s = B*Q / time: where positions/s stops growing with Q is where a larger k stops
being free, and the B columns show how that moves under load. Each cell is timed in both verify
modes of the target worker: `batched` (one GEMM over all B*Q rows) and `batch_invariant` (every
row with one-token kernels, target_worker.batch_invariant; specmesh/engine/rowexact.py), whose
ratio is the price of bitwise-stable output. With --micro-draft it times the draft model instead,
as the draft worker runs it (its dtype, CPU kernel and `weights`), in the default mode only.
"""

from __future__ import annotations

import time

import torch

from specmesh.bench.metrics import percentile


def _prefill(model, n: int, context: int, gen: torch.Generator, vocab: int, chunk: int = 4) -> list:
    """n sequences of `context` random tokens, their KV filled in one shared pool (as the target
    worker holds them), a few sequences per forward."""
    from specmesh.engine.kv import batched_step
    from specmesh.engine.pool import new_pool

    pool = new_pool(model, n * (context + 80))
    kvs = [pool.allocate(context + 80) for _ in range(n)]
    for start in range(0, n, chunk):
        part = kvs[start:start + chunk]
        prompts = [torch.randint(0, vocab, (context,), generator=gen).tolist() for _ in part]
        batched_step(model, part, prompts, logits_rows=[[context - 1]] * len(part))
        for kv in part:
            kv.commit(context)
    return kvs


def tree_mask(nodes: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random prefix-closed tree of `nodes` drafts under the pending token, as [pending, nodes]:
    its ancestor mask [N + 1, N + 1] and depths [N + 1] (specmesh.core.tree)."""
    from specmesh.core.tree import tree_layout

    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=gen)) for i in range(nodes - 1)]
    return tree_layout(parents)


MODES = ("batched", "batch_invariant")


def time_forward(model, kvs: list, positions: int, repeats: int, gen: torch.Generator, vocab: int,
                 row_exact: bool | int = False, tree: int = 0) -> list[float]:
    """Seconds of each of `repeats` forwards of `positions` new tokens per sequence (tree > 0:
    [pending, a random tree of `tree` nodes] with its ancestor mask). Nothing is committed, so
    every forward writes the same slots past each cache."""
    from specmesh.engine.kv import batched_step

    masks = depths = None
    if tree:
        positions = tree + 1
        layouts = [tree_mask(tree, gen) for _ in kvs]
        masks, depths = [m for m, _ in layouts], [d for _, d in layouts]
    inputs = [torch.randint(0, vocab, (positions,), generator=gen).tolist() for _ in kvs]

    def step():
        batched_step(model, kvs, inputs, new_masks=masks, depths=depths, row_exact=row_exact)

    step()  # warm-up (allocator, kernels)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def run_micro(model, context: int = 256, positions=(1, 5, 9), batches=(1, 16), repeats: int = 5,
              seed: int = 0, progress=None, modes=MODES, trees=(16,), row_exact: int = 1) -> list[dict]:
    """Median ms of one forward per (mode, batch, positions or tree); the batch_invariant mode
    as rowexact.rows(row_exact) runs it."""
    from specmesh.engine import rowexact

    if "batch_invariant" in modes:
        rowexact.install(model)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    kvs = _prefill(model, max(batches), context, gen, vocab)
    shapes = [(q, 0) for q in positions] + [(t + 1, t) for t in trees]
    rows = []
    for b in batches:
        for q, tree in shapes:
            for mode in modes:
                exact = row_exact if mode == "batch_invariant" else 0
                times = time_forward(model, kvs[:b], q, repeats, gen, vocab, row_exact=exact, tree=tree)
                med = percentile(times, 50)
                rows.append({"mode": mode, "batch": b, "positions": q, "tree": tree, "context": context,
                             "median_ms": med * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3,
                             "positions_per_s": b * q / med, "repeats": repeats})
                if progress is not None:
                    progress.update(1)
    return rows


def _label(q: int, tree: int) -> str:
    return f"tree of {tree} (+ pending)" if tree else str(q)


def ratios(rows: list[dict]) -> list[str]:
    """The engine targets as lines: each cell / the one-token step at batch 1 (same mode), and the
    deterministic mode / the default."""
    cell = {(r.get("mode", "batched"), r["batch"], r["positions"], r.get("tree", 0)): r["median_ms"] for r in rows}
    out = []
    for mode in MODES:
        one = cell.get((mode, 1, 1, 0))
        if not one:
            continue
        for (m, b, q, t), ms in sorted(cell.items()):
            if m == mode and (b, q, t) != (1, 1, 0):
                out.append(f"- {mode}: batch {b} x {_label(q, t)} = {ms / one:.2f}x the one-token step"
                           + (f" ({ms / cell[(mode, 1, q, t)]:.2f}x batch 1)" if b > 1 and (mode, 1, q, t) in cell else ""))
    for (m, b, q, t), ms in sorted(cell.items()):
        if m == "batch_invariant" and ("batched", b, q, t) in cell:
            out.append(f"- deterministic / default, batch {b} x {_label(q, t)}: {ms / cell[('batched', b, q, t)]:.2f}x")
    return out


def micro_markdown(doc: dict) -> str:
    rows = doc["results"]
    batches = sorted({r["batch"] for r in rows})
    shapes = sorted({(r["positions"], r.get("tree", 0)) for r in rows}, key=lambda x: (x[1] > 0, x))
    modes = [m for m in MODES if any(r.get("mode", "batched") == m for r in rows)]
    cell = {(r.get("mode", "batched"), r["batch"], r["positions"], r.get("tree", 0)): r for r in rows}
    m = doc["machine"]
    lines = [f"## specmesh bench --micro: one verify forward (batched_step), context {doc['context']} tokens",
             "", f"`{doc['command']}`", "",
             f"{m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')} ({m.get('torch_threads')} threads), "
             f"{doc['model']} ({'draft model, ' if doc.get('draft') else ''}{doc.get('dtype', '?')}"
             f"{', int8 weights' if doc.get('weights') == 'int8' else ''}, CPU verify kernel: {doc.get('cpu_kernel', False)}, "
             f"one-token attention folded: {doc.get('attention_fold', {})}, on the exact kernel: "
             f"{doc.get('attention_exact', {})}), "
             f"{m.get('date')}", ""]
    if doc.get("onednn"):
        lines += [f"oneDNN-prepacked bf16 linears (probe: rows bitwise F.linear's, one-row speed-up): {doc['onednn']}", ""]
    if doc.get("bf16_rows"):
        lines += [f"bf16 rows kernel for batched decoder linears (bf16rows.py): {doc['bf16_rows']}", ""]
    if doc.get("row_attn_bf16") is not None and doc.get("dtype") == "bfloat16" and not doc.get("draft"):
        gain = doc.get("row_attn_gain")
        lines += [f"batched rows' attention: {'the row kernel' if doc['row_attn_bf16'] else 'torch SDPA per sequence'}"
                  + (f" (probe: the kernel at {gain}x SDPA's speed)" if gain is not None else "")
                  + (f", up to {doc['row_attn_max']} rows a sequence" if doc["row_attn_bf16"] and doc.get("row_attn_max")
                     else ""), ""]
    if doc.get("row_exact_probe"):
        lines += [f"batch_invariant below: row-exact mode {doc.get('row_exact', 1)} (rowexact.rows), "
                  f"rows per call {doc['row_exact_probe']}", ""]
    lines += ["Median ms per forward (positions/s) — positions Q = k + 1 to verify k drafts", ""]
    for mode in modes:
        lines += [f"**{mode}**", "", "| positions Q | " + " | ".join(f"batch {b}" for b in batches) + " |",
                  "|---|" + "---|" * len(batches)]
        for q, t in shapes:
            cells = [f"{c['median_ms']:.1f} ({c['positions_per_s']:.0f}/s)" if (c := cell.get((mode, b, q, t))) else "-"
                     for b in batches]
            lines.append(f"| {_label(q, t)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["**Ratios**", ""] + ratios(rows) + [""]
    return "\n".join(lines)


def _load(cfg, draft: bool) -> tuple:
    """(dir, model, setup) as the target worker runs it, or with draft as the draft worker runs
    its draft model (draft_worker.draft_model: the target's own when none is named)."""
    from specmesh.engine import attention, bf16rows, cpu_gemm, row_attn, rowexact
    from specmesh.engine.loader import load_configured_model, load_draft_model

    if not draft:
        model_dir, model = load_configured_model(cfg.model.name, cfg.model.path, cfg.model.dtype,
                                                 cfg.model.require_manifest, cfg.model.device)
        attention.configure(cfg.target_worker.attention_fold)
        bf16rows.configure(cfg.target_worker.bf16_rows)
        setup = {"cpu_kernel": bool(cfg.target_worker.cpu_kernel) and cpu_gemm.install(model),
                 "onednn": getattr(model, "_specmesh_onednn_report", {}),  # prepacked bf16 linears (onednn.py)
                 "bf16_rows": getattr(model, "_specmesh_bf16rows_report", {})}  # batched rows' kernel (bf16rows.py)
        # the deterministic mode as the worker runs it: auto's pick where that is one, else true's
        rowexact.install(model)
        mode = rowexact.mode_for(model, cfg.target_worker.batch_invariant) or 1  # off: time true's
        # as the worker does (TargetEngine): bf16 rows on the row kernel in mode 2, and in the batched
        # mode where the CPU kernels are allowed (then mode 1's column keeps HF's SDPA)
        bf16_rows = row_attn.enable_bf16(model, True if mode == 2 else cfg.target_worker.cpu_kernel)
        return model_dir, model, {**setup, "row_attn_bf16": bf16_rows, "row_exact": mode,
                                  "row_attn_gain": getattr(model, "_specmesh_row_attn_gain", None),
                                  "row_attn_max": row_attn.bf16_max_rows(model),
                                  "row_exact_probe": rowexact.probed(model, mode)}
    model_dir, model, setup = load_draft_model(cfg)
    return model_dir, model, {"draft": True, **setup}


def main(args) -> int:
    import json
    import sys
    from pathlib import Path

    from tqdm import tqdm

    from specmesh.bench.compare import command_line, machine_info
    from specmesh.config import load_config
    from specmesh.engine import attention, exactrow
    from specmesh.engine.loader import dtype_name

    cfg = load_config(args.config)
    threads = args.threads or cfg.runtime.torch_threads
    if threads:
        torch.set_num_threads(threads)
    model_dir, model, setup = _load(cfg, getattr(args, "micro_draft", False))
    positions = [int(x) for x in args.micro_positions.split(",") if x]
    batches = [int(x) for x in args.micro_batch.split(",") if x]
    trees = [int(x) for x in getattr(args, "micro_trees", "16").split(",") if x]
    modes = ("batched",) if setup.get("draft") else MODES  # a draft model has no deterministic mode
    with tqdm(total=(len(positions) + len(trees)) * len(batches) * len(modes), file=sys.stderr,
              disable=args.no_progress) as bar:
        rows = run_micro(model, args.micro_context, positions, batches, args.micro_repeats, args.seed, bar,
                         trees=trees, modes=modes, row_exact=setup.get("row_exact", 1))
    doc = {"command": command_line(), "model": str(model_dir), "dtype": dtype_name(next(model.parameters()).dtype),
           **setup, "attention_fold": attention.decisions(), "attention_exact": exactrow.decisions(),
           "device": str(next(model.parameters()).device),
           "context": args.micro_context, "results": rows, "machine": machine_info()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    md = micro_markdown(doc)
    out.with_suffix(".md").write_text(md)
    print(md)
    return 0
