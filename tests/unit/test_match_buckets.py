"""Acceptance rates by the n-gram match's length (core/ngram.py MATCH_BUCKETS): the round policy's
per-bucket k with hand-built costs, the local n-gram past the pace gate, and NgramBurst.by_match
on the wire."""

from __future__ import annotations

import pytest

from coordinator.roundpolicy import RoundPolicy
from specmesh.core.goodput import RateBook
from specmesh.core.pace import PaceBook
from specmesh.core.types import DraftProposal, MatchBucket, NgramBurst
from specmesh.errors import InvalidArgument

COST = {"rows": [1, 2, 5, 9], "seconds": [1.0, 1.1, 1.4, 1.9], "mean_batch": 1.0}


def _policy(book: RateBook | None = None) -> RoundPolicy:
    rp = RoundPolicy(8, book or RateBook())
    rp.take_cost(COST)
    return rp


def test_each_bucket_drafts_as_its_own_rates_pay():
    rp = _policy()
    got = {b.min_match: b.k for b in rp.by_match("ngram", 60)}
    assert list(got) == [1, 2, 3, 4, 8]
    assert 1 <= got[1] < got[4] <= got[8] and got[8] >= 6  # a one-token match drafts little, a copy long
    for _ in range(40):  # this request's two-token matches are never accepted
        rp.learn("ngram~m2", DraftProposal([5, 6, 7]), 0)
    got = {b.min_match: b.k for b in rp.by_match("ngram", 60)}
    assert got[2] == 0 and got[8] >= 6
    assert all(b.k <= 2 for b in rp.by_match("ngram", 2))  # never past the tokens left
    assert rp.k("ngram~m8", 4, 60) == got[8] and rp.k("ngram~m2", 4, 60) == 0


def test_costly_rows_draft_nothing_and_no_cost_model_means_no_buckets():
    rp = RoundPolicy(8, RateBook())
    assert rp.by_match("ngram", 60) == ()  # fixed k: the burst keeps one k for every match
    rp.take_cost({"rows": [1, 2, 9], "seconds": [1.0, 2.0, 9.0], "mean_batch": 1.0})
    assert all(b.k == 0 for b in rp.by_match("ngram", 60)[:-1])  # every row costs a whole step


def test_the_local_ngram_passes_no_pace_gate():
    """A pace book that finds drafting losing turns a gated round's k to 0, never the local n-gram's
    (paced false): its only cost is the target's forward, which goodput prices."""
    book = RateBook(pace=PaceBook(min_rounds=1))
    for _ in range(3):
        book.pace.observe("ngram", True, 1.0, 1)
        book.pace.observe("ngram", False, 0.1, 1)
    rp = _policy(book)
    assert rp.k("ngram~m8", 4, 60) == 0
    assert rp.k("ngram~m8", 4, 60, paced=False) >= 6


def test_a_burst_picks_the_bucket_of_its_match():
    spec = NgramBurst(6, 1, 8, 20, (0.5,), by_match=(MatchBucket(2, 1, (0.4,)), MatchBucket(4, 3), MatchBucket(8, 9)))
    assert spec.for_match(0) == (0, ()) and spec.for_match(1) == (0, ())  # below the first bucket: none
    assert spec.for_match(3) == (1, (0.4,)) and spec.for_match(7) == (3, ())
    assert spec.for_match(12) == (6, ())  # capped at k
    assert NgramBurst(6, 1, 8, 20, (0.5,)).for_match(1) == (6, (0.5,))  # no buckets: k and rates


def test_by_match_crosses_the_wire_and_bad_rates_are_refused():
    from specmesh.rpc.convert import ngram_burst_from_pb, ngram_burst_to_pb
    from specmesh.v1 import specmesh_pb2 as pb

    spec = NgramBurst(4, 1, 8, 12, by_match=(MatchBucket(1, 1, (0.25,)), MatchBucket(8, 4, (0.5, 0.75))))
    req = pb.VerifyRequest(ngram_burst=ngram_burst_to_pb(spec))
    assert ngram_burst_from_pb(req) == spec
    req.ngram_burst.by_match[1].rates.append(1.5)
    with pytest.raises(InvalidArgument, match="ngram_burst.by_match.rates"):
        ngram_burst_from_pb(req)


def test_bucket_rounds_probe_on_the_requests_count():
    """Where no bucket pays, every probe_every-th round of the request under any bucket still
    drafts one position (each bucket's own count, split five ways, seldom got there)."""
    rp = RoundPolicy(8, RateBook())
    rp.take_cost({"rows": [1, 2, 9], "seconds": [1.0, 2.0, 9.0], "mean_batch": 1.0})
    ks = [rp.k(f"ngram~m{b}", 4, 60, paced=False) for b in (1, 2, 3, 4, 8) * 4]
    assert [i for i, k in enumerate(ks) if k] == [7, 15] and max(ks) == 1
