"""Prompt-lookup (n-gram) proposer: draft the tokens that followed an earlier copy of the suffix.

No model and no distributions: proposals are point masses (DraftProposal.probs = None), which
the rejection sampler handles exactly (see rejection.verify_rejection).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class NgramConfig:
    """Match suffixes of min_n..max_n tokens (longest first); propose num_speculative_tokens."""

    min_n: int = 1
    max_n: int = 8
    num_speculative_tokens: int = 4

    def __post_init__(self) -> None:
        _validate(self.num_speculative_tokens, self.min_n, self.max_n)


def propose_ngram(context: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the context's suffix
    (lookup_ngram's tokens)."""
    return lookup_ngram(context, k, min_n, max_n)[1]


def lookup_ngram(context: list[int], k: int, min_n: int, max_n: int) -> tuple[int, list[int]]:
    """(n, up to k tokens that followed the most recent earlier occurrence of the context's suffix).

    For n = max_n down to min_n: let s = context[-n:]; find the largest start j < L - n with
    context[j:j+n] == s (occurrences may overlap the suffix, but are not the suffix itself) and
    return n and context[j+n : j+n+k] (fewer than k if the match ends near the end of the context).
    The first n that matches wins, so longer matches are preferred. (0, []) if none matches; with
    k = 0 the match is still measured (n, []).

    Complexity: one O(L) vectorised pass finds every earlier position e holding the last token;
    each further step d = 1..max_n-1 filters the C surviving candidates with one O(C) compare
    (context[e-d] == context[L-1-d]). Total O(L + max_n * C) time, O(L) memory; C <= L.
    """
    _validate(k, min_n, max_n)
    length = len(context)
    if length < 2:
        return 0, []
    ctx = np.asarray(context, dtype=np.int64)  # [L]
    # ends: [C] positions e <= L-2 whose token equals the last token (a length-1 match ending at e)
    ends = np.flatnonzero(ctx[:-1] == ctx[-1])
    best_end, best_n = -1, 0
    n = 1
    while ends.size and n <= max_n:
        if n >= min_n:
            best_end, best_n = int(ends[-1]), n  # most recent end of a length-n match; grows with n
        # extend to length n+1: need e - n >= 0 and ctx[e - n] == ctx[L-1-n]
        if n == max_n or n >= length - 1:
            break
        ends = ends[ends >= n]
        ends = ends[ctx[ends - n] == ctx[length - 1 - n]]
        n += 1
    if best_end < 0:
        return 0, []
    return best_n, [int(t) for t in ctx[best_end + 1 : best_end + 1 + k]]


# A match's length predicts its draft's acceptance (greedy SmolLM2-135M on MT-Bench, 64 tokens,
# docs/bench/round_policy.md#session-41): a1 0.20 after a one-token match, 0.50 / 0.63 / 0.74 after
# 2 / 3 / 4 tokens, 0.92 after 8 or more. The round policy keeps its rates per bucket (the largest
# bucket <= n): k follows the match instead of one mean over all of them.
MATCH_BUCKETS = (1, 2, 3, 4, 8)


def match_bucket(n: int) -> int:
    """The bucket of an n-token match (0: no match)."""
    return max((b for b in MATCH_BUCKETS if b <= n), default=0)


def match_key(method: str, n: int) -> str:
    """The round policy's key of a round whose draft followed an n-token match (n >= 1)."""
    return f"{method}~m{match_bucket(n)}"


def is_match_key(key: str) -> bool:
    """Whether a round policy key is match_key's (a drafter's key at a match bucket)."""
    return key.rpartition("~m")[2].isdigit()


@dataclass(frozen=True)
class NgramLookup:
    """The n-gram proposer at fixed sizes: called as propose(context, k) -> tokens; match(context,
    k) -> (n, tokens) also tells the match's length (lookup_ngram)."""

    min_n: int
    max_n: int

    def __call__(self, context: list[int], k: int) -> list[int]:
        return propose_ngram(context, k, self.min_n, self.max_n)

    def match(self, context: list[int], k: int) -> tuple[int, list[int]]:
        return lookup_ngram(context, k, self.min_n, self.max_n)


def _validate(k: int, min_n: int, max_n: int) -> None:
    """Raise ValueError unless k >= 0, min_n >= 1 and max_n >= min_n."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if min_n < 1:
        raise ValueError(f"min_n must be >= 1, got {min_n}")
    if max_n < min_n:
        raise ValueError(f"max_n must be >= min_n, got max_n={max_n} min_n={min_n}")
