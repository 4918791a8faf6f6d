"""Prompt-lookup proposer: matching rules, edge cases, argument validation."""

from __future__ import annotations

import random

import pytest

from specmesh.core.ngram import NgramConfig, propose_ngram


def _reference(context: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force O(L * max_n^2) statement of the spec."""
    length = len(context)
    for n in range(max_n, min_n - 1, -1):
        if n >= length:
            continue
        suffix = context[length - n :]
        for j in range(length - n - 1, -1, -1):
            if context[j : j + n] == suffix:
                return context[j + n : j + n + k]
    return []


def test_match_found():
    #          0  1  2  3  4  5  6
    context = [5, 6, 7, 8, 9, 1, 5, 6]
    assert propose_ngram(context, k=3, min_n=1, max_n=4) == [7, 8, 9]


def test_longest_n_preferred():
    # suffix [2, 3]: the 2-gram occurs at 0 (followed by 7); the 1-gram [3] occurs more
    # recently at 5 (followed by 9). The longer match wins.
    context = [2, 3, 7, 0, 0, 3, 9, 2, 3]
    assert propose_ngram(context, k=1, min_n=1, max_n=3) == [7]
    # with max_n=1 only the 1-gram is tried, and its most recent occurrence wins
    assert propose_ngram(context, k=1, min_n=1, max_n=1) == [9]


def test_most_recent_occurrence_preferred():
    context = [4, 1, 4, 2, 4, 3, 4]
    assert propose_ngram(context, k=1, min_n=1, max_n=2) == [3]
    assert propose_ngram(context, k=2, min_n=1, max_n=2) == [3, 4]


def test_fewer_than_k_at_end():
    # the most recent earlier [1, 1] starts at 1 (overlapping the suffix): only one token follows
    assert propose_ngram([1, 1, 1, 1], k=4, min_n=1, max_n=2) == [1]
    assert propose_ngram([8, 9, 8], k=5, min_n=1, max_n=4) == [9, 8]


def test_no_match():
    assert propose_ngram([1, 2, 3, 4], k=3, min_n=1, max_n=4) == []
    assert propose_ngram([], k=3, min_n=1, max_n=4) == []
    assert propose_ngram([7], k=3, min_n=1, max_n=4) == []
    # a match exists only for n=1 but min_n=2 forbids it
    assert propose_ngram([3, 5, 9, 5], k=2, min_n=2, max_n=3) == []
    assert propose_ngram([1, 2, 1], k=0, min_n=1, max_n=2) == []


@pytest.mark.parametrize(
    ("k", "min_n", "max_n"), [(-1, 1, 2), (2, 0, 2), (2, 3, 2), (2, -1, 4)]
)
def test_invalid_args(k, min_n, max_n):
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1, 2], k=k, min_n=min_n, max_n=max_n)


def test_config_defaults_and_validation():
    cfg = NgramConfig()
    assert (cfg.min_n, cfg.max_n, cfg.num_speculative_tokens) == (1, 8, 4)
    with pytest.raises(ValueError):
        NgramConfig(min_n=3, max_n=2)
    with pytest.raises(ValueError):
        NgramConfig(num_speculative_tokens=-1)


def test_matches_brute_force_on_random_contexts():
    rng = random.Random(1234)
    for _ in range(500):
        length = rng.randrange(0, 40)
        context = [rng.randrange(3) for _ in range(length)]
        k, min_n = rng.randrange(0, 6), rng.randrange(1, 4)
        max_n = min_n + rng.randrange(0, 4)
        got = propose_ngram(context, k, min_n, max_n)
        assert got == _reference(context, k, min_n, max_n), (context, k, min_n, max_n)


def test_long_context_is_fast():
    import time

    rng = random.Random(7)
    context = [rng.randrange(50) for _ in range(8000)] + [1, 2, 3, 4]
    context[100:104] = [1, 2, 3, 4]
    start = time.perf_counter()
    for _ in range(50):
        got = propose_ngram(context, k=4, min_n=1, max_n=4)
    assert got == context[104:108]
    assert time.perf_counter() - start < 1.0


def test_lookup_tells_the_length_of_the_match_it_drafts_from():
    """lookup_ngram's n is the longest suffix (min_n..max_n) with an earlier copy, its tokens are
    propose_ngram's; k = 0 still measures the match."""
    from specmesh.core.ngram import NgramLookup, is_match_key, lookup_ngram, match_bucket, match_key

    rng = random.Random(7)
    for _ in range(300):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        k, min_n = rng.randrange(0, 5), rng.randrange(1, 3)
        max_n = min_n + rng.randrange(0, 6)
        n, toks = lookup_ngram(context, k, min_n, max_n)
        assert toks == propose_ngram(context, k, min_n, max_n) == _reference(context, k, min_n, max_n)
        longest = max((m for m in range(min_n, max_n + 1) if m < len(context) and any(
            context[j:j + m] == context[-m:] for j in range(len(context) - m))), default=0)
        assert n == longest
        assert lookup_ngram(context, 0, min_n, max_n) == (n, [])
    assert lookup_ngram([5, 6, 7, 8, 5, 6, 7], 3, 1, 8) == (3, [8, 5, 6])
    assert NgramLookup(1, 8).match([5, 6, 7, 8, 5, 6, 7], 3) == (3, [8, 5, 6])
    assert NgramLookup(1, 8)([5, 6, 7, 8, 5, 6, 7], 2) == [8, 5]
    assert [match_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 30)] == [0, 1, 2, 3, 4, 4, 8, 8]
    assert match_key("ngram", 6) == "ngram~m4"
    assert is_match_key("ngram~m4") and not is_match_key("block~1") and not is_match_key("ngram")
