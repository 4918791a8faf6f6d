"""Cross-run comparisons and the result document: speedup vs AR, break-even concurrency,
1-vs-8 throughput ratio, T=0 token identity (spec vs AR), machine facts, command line.

speedup_vs_ar = output tokens/s of the run / output tokens/s of the mesh "ar" run at the same
level (concurrency, or request rate in open loop); for the in-process peers too, so the
hf_generate row shows the mesh's overhead against plain HF at batch 1.
Token identity (temperature 0 only): every spec run's output of every prompt is compared with
the mesh AR output of that prompt at the lowest level (concurrency 1 when run = unbatched).
Peer differences (hf_generate vs mesh AR, hf_prompt_lookup vs hf_generate) are listed apart
as `peer_mismatches`: HF's prompt lookup verifies its drafts in one batched forward (other GEMM
kernels than its one-token steps), and the mesh's AR may run other kernels than HF (the packed CPU
kernel, float32), so near-ties can legitimately pick another token.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import sys

from specmesh.bench.metrics import break_even, first_difference, speedup

NOTES = [
    "hf_generate, hf_prompt_lookup and hf_assisted run in-process at batch 1, i.e. concurrency 1 only.",
    "Run order: per level, prompts split into two blocks (even/odd index); modes run M1..Mn on "
    "block A then Mn..M1 on block B (ABBA), so machine drift weighs on every mode alike.",
    "ITL: one gap per stream-message arrival (vLLM's definition; a message may carry several "
    "tokens). itl_token_ms: per token, a message's n-1 extra tokens count as zero gaps.",
    "TPOT = (E2E - TTFT) / (output tokens - 1). Acceptance length = tokens per target verify step.",
]


def command_line() -> str:
    """The exact command line of this process, shell-quoted (`specmesh bench ...`)."""
    prog = os.path.basename(sys.argv[0]) or "specmesh"
    if prog in ("__main__.py", "cli.py"):
        prog = "specmesh"
    return shlex.join([prog] + sys.argv[1:])


def machine_info() -> dict:
    import torch
    import transformers

    cpu, ids = platform.processor() or "", {}
    try:  # the first processor's name, family and model ("AMD EPYC" alone names a Zen 3, 4 or 5)
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in ids:
                ids[key] = value.strip()
            if not line.strip() and ids:
                break
    except OSError:
        pass
    if "model name" in ids:
        cpu = ids["model name"]
        if "cpu family" in ids and "model" in ids:
            cpu += f" (family {ids['cpu family']} model {ids['model']})"
    return {
        "cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _key(run: dict) -> float:
    return run["request_rate"] if run.get("request_rate") is not None else run["concurrency"]


def add_speedups(runs: list[dict]) -> None:
    """speedup_vs_ar per run; with several passes (--passes), each mesh spec run's per pass too:
    its pass's tokens/s over AR's in the same pass (speedup_passes)."""
    ar = {_key(r): r for r in runs if r["mode"] == "ar"}
    for r in runs:
        base = ar.get(_key(r))
        r["speedup_vs_ar"] = speedup(r["output_tokens_per_s"], base and base["output_tokens_per_s"]) \
            if r["mode"] != "ar" else 1.0
        if r["mode"] == "ar" and not r["output_tokens_per_s"]:
            r["speedup_vs_ar"] = None
        own, theirs = r.get("pass_tokens_per_s") or [], (base or {}).get("pass_tokens_per_s") or []
        if r["mode"] == "spec" and len(own) > 1 and len(theirs) == len(own):
            r["speedup_passes"] = [speedup(a, b) for a, b in zip(own, theirs)]


def _tokens_per_s_by_category(run: dict) -> dict[str, float]:
    """Per category: output tokens / summed request latency (at concurrency 1, requests run one at
    a time, so this is that category's tokens/s)."""
    sums: dict[str, list[float]] = {}
    for row in run.get("requests", []):  # suite.request_row
        if row.get("error") is None and row.get("category") and row.get("e2e_ms"):
            acc = sums.setdefault(row["category"], [0.0, 0.0])
            acc[0] += row["output_tokens"]
            acc[1] += row["e2e_ms"] / 1e3
    return {c: n / t for c, (n, t) in sums.items() if t > 0}


def category_speedups(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per spec / peer run at concurrency 1: {category: tokens/s over AR's for that category}."""
    ar = next((r for r in runs if r["mode"] == "ar" and r.get("request_rate") is None and r["concurrency"] == 1), None)
    if ar is None:
        return {}
    base = _tokens_per_s_by_category(ar)
    out = {}
    for r in runs:
        if r["mode"] != "ar" and r.get("request_rate") is None and r["concurrency"] == 1:
            mine = _tokens_per_s_by_category(r)
            label = f"{r['mode']}/{r['drafter']}" if r["drafter"] else r["mode"]
            out[label] = {c: mine[c] / base[c] for c in sorted(mine) if base.get(c)}
    return out


def break_evens(runs: list[dict]) -> dict[str, float | None]:
    """Per drafter: the first level where spec no longer beats AR (None if it always does)."""
    out = {}
    for drafter in dict.fromkeys(r["drafter"] for r in runs if r["mode"] == "spec"):
        sp = {_key(r): r["speedup_vs_ar"] for r in runs if r["mode"] == "spec" and r["drafter"] == drafter}
        if any(v is not None for v in sp.values()):
            out[drafter] = break_even(sp)
    return out


def throughput_ratios(runs: list[dict], lo: int = 1, hi: int = 8) -> dict[str, float]:
    """tokens/s at concurrency hi / at concurrency lo, per mesh mode (closed loop)."""
    out = {}
    for r in runs:
        if r["mode"] in ("spec", "ar") and r.get("request_rate") is None and r["concurrency"] == hi:
            base = next((b for b in runs if b["mode"] == r["mode"] and b["drafter"] == r["drafter"]
                         and b.get("request_rate") is None and b["concurrency"] == lo), None)
            if base and base["output_tokens_per_s"]:
                label = f"{r['mode']}/{r['drafter']}" if r["drafter"] else r["mode"]
                out[label] = r["output_tokens_per_s"] / base["output_tokens_per_s"]
    return out


def _outputs(run: dict) -> dict[str, list[int]]:
    return {rec.prompt_id: rec.token_ids for rec in run["_records"] if rec.ok}


def _diffs(run: dict, ref: dict[str, list[int]], against: str) -> list[dict]:
    out = []
    for pid, tokens in _outputs(run).items():
        if pid in ref and (pos := first_difference(tokens, ref[pid])) is not None:
            out.append({"mode": run["mode"], "drafter": run["drafter"], "concurrency": run["concurrency"],
                        "request_rate": run.get("request_rate"), "prompt_id": pid, "first_diff": pos,
                        "against": against})
    return out


def mismatches(runs: list[dict]) -> tuple[list[dict], list[dict], list[dict]]:
    """(spec vs AR, AR at other levels vs AR reference, peer differences)."""
    ar_runs = sorted((r for r in runs if r["mode"] == "ar"), key=_key)
    if not ar_runs:
        return [], [], []
    ref = _outputs(ar_runs[0])
    spec = [d for r in runs if r["mode"] == "spec" for d in _diffs(r, ref, "ar")]
    batching = [d for r in ar_runs[1:] for d in _diffs(r, ref, "ar")]
    peers = []
    hf = next((r for r in runs if r["mode"] == "hf_generate"), None)
    if hf:
        peers += _diffs(hf, ref, "ar")
        peers += [d for r in runs if r["mode"] in ("hf_prompt_lookup", "hf_assisted")
                  for d in _diffs(r, _outputs(hf), "hf_generate")]
    return spec, batching, peers


def summarize_runs(runs: list[dict], args, num_prompts: int) -> dict:
    """The result document (report.check_schema validates it)."""
    order = {"spec": 0, "ar": 1, "hf_generate": 2, "hf_prompt_lookup": 3, "hf_assisted": 4}
    given = [d for d in getattr(args, "drafters", "").split(",") if d]  # drafters in the order asked for
    rank = {d: i for i, d in enumerate(given)}
    runs.sort(key=lambda r: (r.get("request_rate") is not None, _key(r), order.get(r["mode"], 9),
                             rank.get(r["drafter"], len(rank)), r["drafter"] or ""))
    add_speedups(runs)
    by_drafter = break_evens(runs)
    checked = args.temperature == 0 and any(r["mode"] == "ar" for r in runs)
    spec_mm, batch_mm, peer_mm = mismatches(runs) if checked else ([], [], [])
    first = next(iter(by_drafter.values()), None) if by_drafter else None
    open_loop = any(r.get("request_rate") is not None for r in runs)
    for r in runs:
        r.pop("_records", None)
    return {
        "command": command_line(),
        "dataset": args.dataset, "num_prompts": num_prompts, "max_tokens": args.max_tokens,
        "temperature": args.temperature, "seed": args.seed, "k": getattr(args, "k", None),
        "k_given": getattr(args, "k_given", True),
        "torch_threads_setting": getattr(args, "threads", 0),
        "runs": runs,
        "break_even_concurrency": None if open_loop else first,
        "break_even_request_rate": first if open_loop else None,
        "break_even_by_drafter": by_drafter,
        "throughput_ratio_8_vs_1": throughput_ratios(runs),
        "speedup_by_category": category_speedups(runs),
        "mismatch_checked": checked, "mismatches": len(spec_mm), "mismatch_details": spec_mm,
        "batching_mismatches": batch_mm, "peer_mismatches": peer_mm,
        "machine": machine_info(), "notes": NOTES,
    }
