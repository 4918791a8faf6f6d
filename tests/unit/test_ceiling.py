"""The prompt-lookup ceiling's replay (specmesh/bench/ceiling.py) on hand-built continuations."""

import pytest

from specmesh.bench.ceiling import ceiling, forward_cost, replay

MICRO = {"results": [{"batch": 1, "positions": 1, "median_ms": 40.0, "mode": "batch_invariant"},
                     {"batch": 1, "positions": 5, "median_ms": 48.0, "mode": "batch_invariant"},
                     {"batch": 1, "positions": 9, "median_ms": 64.0, "mode": "batch_invariant"},
                     {"batch": 1, "positions": 5, "median_ms": 99.0, "mode": "batched"},
                     {"batch": 16, "positions": 1, "median_ms": 99.0, "mode": "batch_invariant"}]}


def test_forward_cost_interpolates_the_chosen_mode_at_batch_1():
    cost = forward_cost(MICRO)
    assert cost(1) == 40.0 and cost(3) == pytest.approx(44.0) and cost(9) == 64.0 and cost(13) == pytest.approx(80.0)
    with pytest.raises(ValueError):
        forward_cost(MICRO, "batched")  # no 1-position row in that mode


def test_oracle_drafts_only_what_is_accepted_and_fixed_pays_for_every_draft():
    cost = forward_cost(MICRO)
    context = [1, 2, 3, 4, 5, 6]
    copy = [9, 1, 2, 3, 4, 5, 6, 7]  # after "9 1" the lookup drafts 2 3 4 5 6 (all accepted), then 1 2...
    tokens, rounds, ms = replay(context, copy, cost, k_max=8, min_n=1, max_n=4)
    assert tokens == 7
    # round 1 at "..6 9": 9 never seen -> no draft, emits 1; round 2 at "9 1": drafts 2 3 4 5 6 (+ bonus 7 cut
    # by the end: a round emits at most what is left), emits the rest
    assert rounds == 2 and ms == pytest.approx(cost(1) + cost(6))
    fixed = replay(context, copy, cost, k_max=8, min_n=1, max_n=4, fixed=2)
    assert fixed[0] == 7 and fixed[2] >= ms
    # nothing to copy: every round one token at one position's cost, whatever the policy
    assert replay([1, 2], [3, 4, 5, 6], cost, 8, 1, 4) == (3, 3, pytest.approx(3 * cost(1)))


def test_ceiling_reports_per_category_and_overall():
    cost = forward_cost(MICRO)
    samples = [{"category": "copy", "prompt_ids": [1, 2, 3, 4, 5, 6], "output_ids": [1, 2, 3, 4, 5, 6, 1, 2]},
               {"category": "new", "prompt_ids": [1, 2], "output_ids": [3, 4, 5, 6]}]
    out = ceiling(samples, cost, k_max=8, min_n=1, max_n=4, fixed=4)
    assert set(out) == {"copy", "new", "all"}
    assert out["new"]["oracle"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert out["copy"]["oracle"]["speedup_vs_ar"] > 2.0
    assert out["copy"]["oracle"]["speedup_vs_ar"] >= out["copy"]["fixed_k4"]["speedup_vs_ar"]
    assert 1.0 < out["all"]["oracle"]["speedup_vs_ar"] < out["copy"]["oracle"]["speedup_vs_ar"]


def test_forward_cost_reads_a_noisy_micro_monotone():
    noisy = {"results": [{"batch": 1, "positions": q, "median_ms": ms, "mode": "batch_invariant"}
                         for q, ms in ((1, 46.1), (2, 48.2), (3, 53.6), (4, 62.0), (5, 56.9), (9, 68.3))]}
    cost = forward_cost(noisy)
    est = [cost(q) for q in range(1, 10)]
    assert est == sorted(est) and cost(4) == pytest.approx((62.0 + 56.9) / 2)


def test_main_reads_cached_continuations_and_writes_json_and_markdown(tmp_path):
    import json

    from specmesh.bench.ceiling import main

    micro, samples, out = tmp_path / "micro.json", tmp_path / "samples.jsonl", tmp_path / "ceiling.json"
    micro.write_text(json.dumps(MICRO))
    rows = [{"prompt_id": "a", "category": "copy", "prompt_ids": [1, 2, 3, 4, 5, 6], "output_ids": [1, 2, 3, 4, 5, 6, 1, 2]},
            {"prompt_id": "b", "category": "new", "prompt_ids": [1, 2], "output_ids": [3, 4, 5, 6]}]
    samples.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--micro", str(micro), "--samples", str(samples), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["prompts"] == 2 and doc["ceiling"]["new"]["oracle"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert "| copy |" in out.with_suffix(".md").read_text()


def test_match_rates_are_counted_by_the_length_of_the_match():
    """A continuation that repeats its prompt: once the suffix has matched 8+ tokens every lookup
    drafts the rest right (a_j 1.0); a one-token match that leads astray counts a miss at a_1."""
    from specmesh.bench.ceiling import bucket_label, match_rates

    prompt = list(range(100, 120))
    rates = match_rates([{"prompt_ids": prompt, "output_ids": prompt[:16]}], 4, 1, 8)
    assert rates[8]["positions"] == 8 and rates[8]["rates"] == [1.0, 1.0, 1.0, 1.0]
    assert sum(r["positions"] for r in rates.values()) == 15  # every position after the prefill's matched
    miss = match_rates([{"prompt_ids": [5, 6, 5, 7], "output_ids": [9, 5, 8]}], 2, 1, 8)
    assert miss[1] == {"positions": 1, "rates": [0.0, None]}  # ...5 matched once, drafted 7 (or 6), got 8
    assert [bucket_label(b) for b in (1, 2, 3, 4, 8)] == ["1", "2", "3", "4-7", "8+"]
