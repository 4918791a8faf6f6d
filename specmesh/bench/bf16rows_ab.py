"""The bf16 rows kernel on and off in one process, forwards interleaved (specmesh/engine/bf16rows.py):
`python -m specmesh.bench.bf16rows_ab --rounds 8`. The target loaded as the worker loads it
(default config, `target_worker.bf16_rows: true` so the copies exist), then each (batch, rows)
forward of the micro-bench timed twice per round with the kernel on and twice off, the order
alternating by round: a VM's slow spells weigh on both alike, which separate micro-bench runs
do not give (their one-token steps read 31.8-41.4 ms an hour apart on one Xeon). Batched mode
only (the kernel's)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

CASES = ((1, 1, 0), (1, 2, 0), (1, 5, 0), (1, 9, 0), (1, 17, 16), (4, 1, 0), (4, 5, 0), (16, 1, 0), (16, 5, 0))


def run(rounds: int, context: int, threads: int) -> dict:
    from specmesh.bench import micro
    from specmesh.bench.compare import machine_info
    from specmesh.config import load_config
    from specmesh.engine import bf16rows

    torch.set_num_threads(threads)
    cfg = load_config(None)
    bf16rows.configure(True)
    _, model, setup = micro._load(cfg, False)
    if not setup.get("bf16_rows", {}).get("used"):
        raise SystemExit(f"the bf16 rows kernel is not available here: {setup.get('bf16_rows')}")
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    kvs = micro._prefill(model, max(b for b, _, _ in CASES), context, gen, vocab)
    times: dict[tuple, list[float]] = {(c, on): [] for c in CASES for on in (True, False)}
    for r in range(rounds):
        for case in CASES:
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                bf16rows.ENABLED = on
                b, q, tree = case
                times[(case, on)] += micro.time_forward(model, kvs[:b], q, 2, gen, vocab, row_exact=0, tree=tree)
    bf16rows.ENABLED = True
    rows = []
    for b, q, tree in CASES:
        on, off = (statistics.median(times[((b, q, tree), x)]) * 1e3 for x in (True, False))
        rows.append({"batch": b, "positions": q, "tree": tree, "kernel_ms": round(on, 1), "onednn_ms": round(off, 1)})
    return {"command": " ".join(sys.argv), "machine": machine_info(), "context": context, "rounds": rounds,
            "probe": setup["bf16_rows"], "results": rows}


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"`{doc['command']}`", "", f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}; context "
             f"{doc['context']}, median of {2 * doc['rounds']} forwards each", "", "| forward | kernel on, ms | off (oneDNN), ms | on / off |", "| --- | --- | --- | --- |"]
    for r in doc["results"]:
        what = f"tree of {r['tree']} (+ pending)" if r["tree"] else f"{r['positions']} positions"
        lines.append(f"| batch {r['batch']} x {what} | {r['kernel_ms']} | {r['onednn_ms']} | "
                     f"{r['kernel_ms'] / r['onednn_ms']:.2f}x |")
    return "\n".join(lines + ["", f"start-up probe: {doc['probe']}", ""])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the JSON here (and the markdown beside it)")
    args = ap.parse_args(argv)
    doc = run(args.rounds, args.context, args.threads)
    text = markdown(doc)
    print(text)
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
