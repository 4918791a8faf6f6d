"""The benchmark's outputs: JSON (with a schema check), a markdown report, PNG plots.

For --out DIR/NAME.json: DIR/NAME.json, DIR/NAME.md and DIR/NAME_throughput.png,
DIR/NAME_acceptance_by_category.png (when a run has categories), DIR/NAME_latency_cdf.png,
DIR/NAME_cost.png (with --price: USD per 1M output tokens, specmesh/bench/pricing.py).
"""

from __future__ import annotations

import json
import numbers
import statistics
from pathlib import Path

from specmesh.bench import pricing

MODES = ("spec", "ar", "hf_generate", "hf_prompt_lookup", "hf_assisted")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def _num(v, nullable: bool = False) -> bool:
    return (v is None and nullable) or (isinstance(v, numbers.Real) and not isinstance(v, bool))


def _int(v, nullable: bool = False) -> bool:
    return (v is None and nullable) or (isinstance(v, int) and not isinstance(v, bool))


def _run_errors(i: int, run) -> list[str]:
    if not isinstance(run, dict):
        return [f"runs[{i}]: not an object"]
    errs = []
    checks = [("mode", run.get("mode") in MODES), ("drafter", run.get("drafter") is None or isinstance(run.get("drafter"), str)),
              ("concurrency", _int(run.get("concurrency"))), ("num_requests", _int(run.get("num_requests"))),
              ("num_errors", _int(run.get("num_errors"))), ("output_tokens_per_s", _num(run.get("output_tokens_per_s"))),
              ("mean_acceptance_length", _num(run.get("mean_acceptance_length"), True)),
              ("speedup_vs_ar", _num(run.get("speedup_vs_ar"), True)),
              ("acceptance_per_position", isinstance(run.get("acceptance_per_position"), list)
               and all(_num(x) for x in run.get("acceptance_per_position")))]
    errs += [f"runs[{i}].{name}: missing or wrong type" for name, ok in checks if not ok]
    for name in LATENCIES:
        d = run.get(name)
        if not isinstance(d, dict) or any(not _num(d.get(p), True) or p not in d for p in ("p50", "p90", "p99")):
            errs.append(f"runs[{i}].{name}: needs p50, p90, p99 (numbers or null)")
    return errs


def schema_errors(doc) -> list[str]:
    """Everything wrong with a result document ([] = valid)."""
    if not isinstance(doc, dict):
        return ["document: not an object"]
    errs = []
    if not isinstance(doc.get("runs"), list) or not doc["runs"]:
        errs.append("runs: missing or empty")
    else:
        for i, run in enumerate(doc["runs"]):
            errs += _run_errors(i, run)
    if not _int(doc.get("break_even_concurrency"), True) or "break_even_concurrency" not in doc:
        errs.append("break_even_concurrency: missing or not int|null")
    if not _int(doc.get("mismatches")):
        errs.append("mismatches: missing or not int")
    machine = doc.get("machine")
    if not isinstance(machine, dict) or any(k not in machine for k in ("cpu", "cores", "torch", "date")):
        errs.append("machine: needs cpu, cores, torch, date")
    if not isinstance(doc.get("command"), str) or not doc.get("command"):
        errs.append("command: missing")
    return errs + pricing.cost_errors(doc)


def check_schema(doc) -> None:
    errs = schema_errors(doc)
    if errs:
        raise ValueError("bench result does not match the schema:\n  " + "\n  ".join(errs))


def _f(v, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _pct(d: dict) -> str:
    return "/".join(_f(d.get(p), "{:.0f}") for p in ("p50", "p90", "p99"))


def _label(run: dict) -> str:
    return f"{run['mode']}/{run['drafter']}" if run.get("drafter") else run["mode"]


def _level(run: dict) -> str:
    return f"{run['request_rate']}/s" if run.get("request_rate") is not None else str(run["concurrency"])


def runs_table(doc: dict) -> list[str]:
    head = ("| mode | drafter | conc (or rate) | reqs | errs | out tok/s | req/s | TTFT ms p50/90/99 | TPOT ms p50/90/99 "
            "| ITL ms p50/90/99 | E2E ms p50/90/99 | acc. len | speedup vs AR |")
    lines = [head, "|" + "---|" * 13]
    for r in doc["runs"]:
        conc = _level(r) + (" (batch 1)" if r.get("batch_1_only") else "")
        lines.append(f"| {r['mode']} | {r['drafter'] or '-'} | {conc} | {r['num_requests']} | {r['num_errors']} "
                     f"| {_f(r['output_tokens_per_s'], '{:.2f}')} | {_f(r.get('requests_per_s'), '{:.3f}')} "
                     f"| {_pct(r['ttft_ms'])} | {_pct(r['tpot_ms'])} | {_pct(r['itl_ms'])} | {_pct(r['e2e_ms'])} "
                     f"| {_f(r['mean_acceptance_length'], '{:.2f}')} | {_f(r['speedup_vs_ar'], '{:.2f}x')} |")
    return lines


def acceptance_section(doc: dict) -> list[str]:
    lines = []
    for r in doc["runs"]:
        if r["mean_acceptance_length"] is None:
            continue
        pos = " ".join(f"{x:.2f}" for x in r["acceptance_per_position"]) or "-"
        hist = " ".join(f"{k}:{v}" for k, v in r.get("acceptance_length_histogram", {}).items()) or "-"
        tf = r.get("time_fraction") or {}
        frac = (f"; drafting {tf['drafting']:.0%} / verifying {tf['verifying']:.0%} of E2E" if tf else "")
        ks = r.get("chosen_k_histogram") or {}
        chosen = ""
        if ks:
            zero = ks.get("0", 0) / max(1, sum(ks.values()))
            chosen = "; chosen k {" + " ".join(f"{k}:{v}" for k, v in ks.items()) + f"}} (k = 0 in {zero:.0%} of rounds)"
        if r.get("trimmed_share"):
            chosen += f"; {r['trimmed_share']:.0%} of drafts trimmed by the target beside others"
        pre = r.get("predraft")
        pre = (f"; pre-drafts {pre['hits']} hit / {pre['misses']} missed ({pre['hit_rate']:.0%}), "
               f"{pre['wait_s_per_round'] * 1e3:.0f} ms waited for a hit per round"
               + (f", {pre['waited_share']:.0%} of rounds waited for a draft" if pre.get("waited_share") else "")
               if pre else "")
        graft = r.get("graft")
        pre += (f"; {graft['share']:.0%} of rounds carried an n-gram graft, {graft['tokens']} tokens accepted on it"
                if graft else "")
        lines.append(f"- {_label(r)} @ {_level(r)}: per-position acceptance [{pos}]; "
                     f"acceptance-length histogram {{{hist}}}{chosen}{frac}{pre}")
    return (["", "### Acceptance"] + lines) if lines else []


def passes_section(doc: dict) -> list[str]:
    """Each spec run's speed-up vs AR per pass (--passes): the pooled table's ratio and the spread
    this machine showed within the same run."""
    lines = []
    for r in doc["runs"]:
        got = [x for x in r.get("speedup_passes") or [] if x is not None]
        if len(got) < 2:
            continue
        mid = statistics.median(got)
        lines.append(f"- {_label(r)} @ {_level(r)}: " + " / ".join(f"{x:.2f}x" for x in got)
                     + f" (median {mid:.2f}x, range {min(got):.2f}x-{max(got):.2f}x)")
    return (["", "### Speed-up vs AR by pass (each pass ABBA over every prompt; the table pools them)"]
            + lines) if lines else []


def category_section(doc: dict) -> list[str]:
    per = {}
    for r in doc["runs"]:
        if r.get("acceptance_by_category"):
            per.setdefault(_label(r), {}).update({c: v for c, v in r["acceptance_by_category"].items()
                                                   if c not in per.get(_label(r), {})})
    if not per:
        return []
    cats = sorted({c for d in per.values() for c in d})
    lines = ["", "### Mean acceptance length per category (lowest level)",
             "| mode | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
    lines += [f"| {m} | " + " | ".join(_f(d.get(c), "{:.2f}") for c in cats) + " |" for m, d in per.items()]
    speed = doc.get("speedup_by_category") or {}
    if speed:
        lines += ["", "### Speed-up vs AR per category (concurrency 1: tokens/s of the category's requests)",
                  "| mode | " + " | ".join(cats) + " |", "|---|" + "---|" * len(cats)]
        lines += [f"| {m} | " + " | ".join(_f(d.get(c), "{:.2f}x") for c in cats) + " |" for m, d in speed.items()]
    return lines


def cost_section(doc: dict) -> list[str]:
    """The target worker's verify cost model at the end of the run (what goodput k chose from)."""
    cost = doc.get("target_cost")
    if not cost or not cost.get("rows"):
        return []
    cells = ", ".join(f"{r}: {s * 1e3:.1f}" for r, s in zip(cost["rows"], cost["seconds"]))
    base = cost["seconds"][0]
    ratios = ", ".join(f"{r}: {s / base:.2f}x" for r, s in zip(cost["rows"], cost["seconds"]))
    batches = ", ".join(f"{b}: {sec * 1e3:.1f}" + (f" + {m * 1e3:.2f} per extra row" if m >= 0 else "")
                        for b, sec, m in zip(cost.get("batches", ()), cost.get("batch_seconds", ()),
                                             cost.get("batch_slopes", ())))
    return ["", "### Target verify cost model (end of run; rows -> ms of one forward)",
            f"- {cells} (mean batch {cost.get('mean_batch', 1.0):.1f})", f"- relative to one row: {ratios}"] + (
        [f"- sequences -> ms of a one-row step each: {batches}"] if batches else [])


def summary_section(doc: dict) -> list[str]:
    lines = ["", "### Summary"]
    which = "request rate" if any(r.get("request_rate") is not None for r in doc["runs"]) else "concurrency"
    value = doc.get("break_even_request_rate") if which == "request rate" else doc.get("break_even_concurrency")
    per = doc.get("break_even_by_drafter") or "n/a (needs --compare)"
    lines.append(f"- break-even {which} (first level where spec no longer beats AR; None = never): "
                 f"{value} (per drafter: {per})")
    for label, ratio in (doc.get("throughput_ratio_8_vs_1") or {}).items():
        lines.append(f"- 8 vs 1 concurrent requests, {label}: {ratio:.2f}x tokens/s")
    if doc.get("mismatch_checked"):
        which = sorted({d["prompt_id"] for d in doc.get("mismatch_details", [])})
        lines.append(f"- T=0 token identity spec vs AR: {doc['mismatches']} mismatch(es)"
                     + (f" on {', '.join(which)}" if which else ""))
        if doc.get("batching_mismatches"):
            lines.append(f"- AR at higher concurrency vs AR reference: {len(doc['batching_mismatches'])} difference(s)")
        if doc.get("peer_mismatches"):
            ids = sorted({f"{d['mode']}:{d['prompt_id']}" for d in doc["peer_mismatches"]})
            lines.append(f"- peer outputs differing (batched verify in HF's prompt lookup, other kernels; "
                         f"informational): {', '.join(ids)}")
    else:
        lines.append("- T=0 token identity: not checked (needs --compare and --temperature 0)")
    lines += [f"- note: {n}" for n in doc.get("notes", [])]
    return lines


def to_markdown(doc: dict) -> str:
    title = (f"## specmesh bench: {doc.get('dataset')}, {doc.get('num_prompts')} prompts, "
             f"max_tokens {doc.get('max_tokens')}, T={doc.get('temperature')}, " + (f"k={doc.get('k')}" if doc.get("k_given", True) else
                    f"k: the mesh's policy ({(doc.get('mesh_config') or {}).get('k_policy', '?')}); peers k={doc.get('k')}"))
    m = doc.get("machine", {})
    mc = doc.get("mesh_config") or {}
    setting = (f"; target {mc.get('dtype')}, batch_invariant {str(mc.get('batch_invariant')).lower()}" if mc else "")
    wall = f"; the whole run took {doc['wall_s'] / 60:.1f} min" if doc.get("wall_s") else ""
    lines = [title, "", f"`{doc.get('command')}`", "",
             f"{m.get('cpu')}, {m.get('cores')} cores, torch {m.get('torch')}, {m.get('date')}{setting}{wall}", ""]
    lines += runs_table(doc) + pricing.markdown_section(doc) + passes_section(doc) + acceptance_section(doc) \
        + category_section(doc) \
        + cost_section(doc) + summary_section(doc)
    return "\n".join(lines) + "\n"


def write_all(doc: dict, out: str | Path, plots: bool = True) -> list[Path]:
    """Validate, then write the JSON, the markdown and (plots=True) the PNGs; returns the paths."""
    check_schema(doc)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    md = out.with_suffix(".md")
    md.write_text(to_markdown(doc))
    written = [out, md]
    if plots:
        written += write_plots(doc, out)
    return written


def _plot_by_level(doc: dict, ax, value, ylabel: str, title: str) -> None:
    """One line per mode: value(run) against the run's level (runs whose value is None left out)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in doc["runs"]:
        if value(r) is not None:
            series.setdefault(_label(r), []).append((r["request_rate"] if r.get("request_rate") is not None
                                                     else r["concurrency"], value(r)))
    for label, pts in series.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    open_loop = any(r.get("request_rate") is not None for r in doc["runs"])
    levels = sorted({x for pts in series.values() for x, _ in pts})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [f"{x:g}" for x in levels])
    ax.minorticks_off()
    ax.set_xlabel("request rate (req/s)" if open_loop else "concurrency (peers: batch 1)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")


def _plot_throughput(doc: dict, ax) -> None:
    _plot_by_level(doc, ax, lambda r: r["output_tokens_per_s"], "output tokens/s", "Throughput vs load")


def _plot_cost(doc: dict, ax) -> bool:
    if not doc.get("price"):
        return False
    _plot_by_level(doc, ax, lambda r: r["cost"]["usd_per_million_output_tokens"], "USD per 1M output tokens",
                   "Cost per million output tokens vs load")
    return True


def _plot_categories(doc: dict, ax) -> bool:
    per: dict[str, dict[str, float]] = {}
    for r in doc["runs"]:  # runs are sorted by level: keep each mode's lowest level
        if r.get("acceptance_by_category") and _label(r) not in per:
            per[_label(r)] = r["acceptance_by_category"]
    if not per:
        return False
    cats = sorted({c for d in per.values() for c in d})
    width = 0.8 / len(per)
    for i, (label, d) in enumerate(per.items()):
        ax.bar([x + i * width for x in range(len(cats))], [d.get(c, 0.0) for c in cats], width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cats))], cats, rotation=30, ha="right")
    ax.set_ylabel("mean acceptance length (tokens / target step)")
    ax.set_title("Acceptance length per category")
    ax.legend(fontsize="small")
    return True


def _plot_cdf(doc: dict, ax) -> None:
    for r in doc["runs"]:
        xs = sorted(q["e2e_ms"] for q in r.get("requests", []) if q.get("e2e_ms") is not None)
        if xs:
            ax.step([xs[0]] + xs, [0.0] + [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                    label=f"{_label(r)} @ {_level(r)}")
    ax.set_xlabel("end-to-end latency (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Latency CDF")
    ax.legend(fontsize="x-small")


def write_plots(doc: dict, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for suffix, draw in (("throughput", _plot_throughput), ("acceptance_by_category", _plot_categories),
                         ("latency_cdf", _plot_cdf), ("cost", _plot_cost)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        if draw(doc, ax) is not False:
            fig.tight_layout()
            path = out.with_name(f"{out.stem}_{suffix}.png")
            fig.savefig(path, dpi=110)
            written.append(path)
        plt.close(fig)
    return written
