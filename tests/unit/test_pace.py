"""The measured pace of drafting vs the target alone (specmesh/core/pace.py) and its gate on the
round policy's k: hand-built round times, no servers."""

from __future__ import annotations

from coordinator.roundpolicy import RoundPolicy
from specmesh.core.goodput import RateBook
from specmesh.core.pace import PaceBook


def _rounds(book: PaceBook, method: str, drafted: bool, seconds: float, tokens: int, n: int) -> None:
    for _ in range(n):
        book.observe(method, drafted, seconds, tokens)


def test_drafting_loses_only_once_both_arms_are_measured_and_past_the_margin():
    book = PaceBook(min_rounds=4, margin=0.05)
    _rounds(book, "block", True, 0.062, 1, 10)  # 1.14-token rounds at ~62 ms: ~62 ms a token
    assert not book.loses("block")  # the target alone not measured yet
    _rounds(book, "block", False, 0.176, 4, 3)  # 4-token bursts, 44 ms a token
    assert not book.loses("block")  # 3 < min_rounds
    book.observe("block", False, 0.176, 4)
    assert book.loses("block") and not book.loses("ngram")
    other = PaceBook(min_rounds=4, margin=0.05)
    _rounds(other, "ngram", True, 0.060, 2, 8)  # 30 ms a token
    _rounds(other, "ngram", False, 0.140, 4, 8)  # 35 ms a token: drafting pays
    assert not other.loses("ngram")
    _rounds(other, "ngram", True, 0.0360, 1, 40)  # 36 ms vs 35: within the margin, drafting stays
    assert not other.loses("ngram")
    assert other.snapshot()["ngram"]["alone"] == (35.0, 8)


def test_empty_or_instant_rounds_teach_nothing():
    book = PaceBook(min_rounds=1)
    book.observe("ngram", True, 0.0, 3)
    book.observe("ngram", False, 0.05, 0)
    assert book.snapshot() == {}


def test_gate_turns_a_losing_drafter_off_but_probes_it_every_nth_round():
    book = PaceBook(min_rounds=2, every=4, every_max=4)  # no back-off: a probe every 4th round
    _rounds(book, "block", True, 0.06, 1, 2)
    _rounds(book, "block", False, 0.04, 1, 2)
    got = [book.gate("block", 3) for _ in range(8)]
    assert got == [0, 0, 0, 3, 0, 0, 0, 3]  # the 4th and 8th drafting choices draft anyway
    assert book.gate("block", 0) == 0 and book.gate("ngram", 2) == 2  # k = 0 stays; another drafter is free


def test_each_probe_that_finds_the_drafter_still_losing_doubles_the_wait_for_the_next():
    book = PaceBook(min_rounds=2, every=4, every_max=32, stale=1000)
    _rounds(book, "block", True, 0.06, 1, 2)
    _rounds(book, "block", False, 0.04, 1, 2)  # drafting: 60 ms a token against 40
    got = [book.gate("block", 3) for _ in range(130)]
    assert [i + 1 for i, k in enumerate(got) if k] == [4, 12, 28, 60, 92, 124]  # waits 8, 16, 32, then 32
    assert sum(1 for k in got if k) == 6  # against 32 at a fixed 1 in 4
    _rounds(book, "block", True, 0.02, 1, 30)  # drafting pays now (20 ms a token)
    got = [book.gate("block", 3) for _ in range(8)]
    assert got == [3] * 8  # paying: drafts every round, and the back-off is gone
    _rounds(book, "block", True, 0.06, 1, 30)  # losing again: probes every 4th round first
    got = [book.gate("block", 3) for _ in range(12)]
    assert [i for i, k in enumerate(got) if k] == [1, 9]  # ticks 140 (a multiple of 4), then 8 later


def test_gate_measures_the_target_alone_now_and_then_while_it_is_unknown_or_stale():
    book = PaceBook(min_rounds=2, every=4, stale=8)
    got = [book.gate("ngram", 2) for _ in range(8)]
    assert got == [2, 2, 2, 0, 2, 2, 2, 0]  # the alone arm unknown: every 4th round runs k = 0
    _rounds(book, "ngram", True, 0.03, 1, 2)
    _rounds(book, "ngram", False, 0.04, 1, 2)  # drafting pays: 30 vs 40 ms a token
    got = [book.gate("ngram", 2) for _ in range(8)]
    assert got == [2] * 8  # known and fresh: no forced k = 0
    got = [book.gate("ngram", 2) for _ in range(8)]
    assert 0 in got  # more than `stale` drafting rounds since the alone arm's last round: measured again


def test_round_policy_gates_goodput_k_by_the_drafter_s_pace_tails_included():
    book = RateBook()
    book.pace = PaceBook(min_rounds=2, every=1000)
    cost = {"rows": [1, 9], "seconds": [1.0, 1.1], "mean_batch": 1.0}
    rp = RoundPolicy(k_max=8, rate_book=book, tree_budget=8)
    rp.take_cost(cost)
    assert rp.k("block", 4, limit=50) == 4 and rp.nodes == 8  # goodput drafts; no pace yet
    rp.observe("block", True, 0.500, 1)  # a request's first drafting round (waited for its table): uncounted
    for _ in range(2):
        rp.observe("block", True, 0.062, 1)
    rp.observe("block", False, 0.176, 4)
    rp.observe("block", True, 0.500, 1)  # right after a round that did not draft: uncounted
    rp.observe("block", False, 0.176, 4)
    rp.observe("off", False, 0.001, 4)  # speculation off: not an arm of any drafter
    assert book.pace.snapshot() == {"block": {"draft": (62.0, 2), "alone": (44.0, 2)}}
    assert rp.k("block~1", 4, limit=50) == 0 and rp.nodes == 0  # a tail's key gated as its drafter
    fixed = RoundPolicy(k_max=0, rate_book=book)  # an explicit k: fixed, never gated
    fixed.take_cost(cost)
    assert fixed.k("block", 3, limit=50) == 3


def test_a_probe_of_a_losing_drafter_drafts_several_rounds_in_a_row():
    from specmesh.core.pace import PROBE_ROUNDS

    book = RateBook()
    book.pace = PaceBook(min_rounds=1, every=4, every_max=4)  # no back-off
    book.pace.observe("ngram", True, 0.30, 1)  # 300 ms a drafting round: a loss at any expected tokens (<= 9)
    book.pace.observe("ngram", False, 0.03, 1)
    rp = RoundPolicy(k_max=8, rate_book=book)
    rp.take_cost({"rows": [1, 9], "seconds": [1.0, 1.0], "mean_batch": 1.0})
    got = [rp.k("ngram", 4, limit=50) > 0 for _ in range(12)]
    assert got == [False] * 3 + [True] * PROBE_ROUNDS + [False] * 3 + [True] * PROBE_ROUNDS


def test_without_a_pace_book_goodput_k_is_never_gated():
    """speculative.pace_gate false: the coordinator's book has no pace, rounds are not observed."""
    from specmesh.config import load_config

    assert load_config(environ={}).speculative.pace_gate is True
    book = RateBook()
    assert book.pace is None
    rp = RoundPolicy(k_max=8, rate_book=book, tree_budget=8)
    rp.take_cost({"rows": [1, 9], "seconds": [1.0, 1.1], "mean_batch": 1.0})
    for _ in range(20):
        rp.observe("block", True, 1.0, 1)
        rp.observe("block", False, 0.01, 4)
    assert all(rp.k("block", 4, limit=50) == 4 for _ in range(40))


def test_a_round_is_priced_at_its_request_s_expected_tokens_where_known():
    """The drafting arm's seconds a round over this request's expected tokens: a drafter that loses
    on the population (1.1 tokens a round) still drafts for a request expecting 2.5."""
    book = PaceBook(min_rounds=2, every=1000)
    _rounds(book, "ngram", True, 0.030, 1, 4)  # ~1 token per 30 ms round
    _rounds(book, "ngram", False, 0.024, 1, 4)  # the target alone: 24 ms a token
    assert book.loses("ngram") and book.loses("ngram", expected=1.1)  # 27.3 ms a token > 24 x 1.05
    assert not book.loses("ngram", expected=2.5)  # 12 ms a token
    assert book.gate("ngram", 4, expected=1.1) == 0 and book.gate("ngram", 4, expected=2.5) == 4
    assert book.gate("ngram", 4) == 0  # no expectation: the arm's own tokens


def test_round_policy_passes_its_chain_s_expected_tokens_to_the_gate():
    book = RateBook()
    book.pace = PaceBook(min_rounds=2, every=1000)
    _rounds(book.pace, "ngram", True, 0.030, 1, 4)
    _rounds(book.pace, "ngram", False, 0.024, 1, 4)
    cost = {"rows": [1, 9], "seconds": [0.024, 0.030], "mean_batch": 1.0}
    low, high = RoundPolicy(k_max=4, rate_book=book), RoundPolicy(k_max=4, rate_book=book)
    for rp, rate in ((low, 0.1), (high, 0.9)):
        rp.take_cost(cost)
        rp.policies["ngram"] = rp._policy("ngram")
        rp.policies["ngram"].rates = [rate] * 4
    assert low.k("ngram", 4, limit=50) == 0  # goodput drafts, the gate holds it at its 1.1 tokens
    assert high.k("ngram", 4, limit=50) > 0  # ~3.4 expected tokens: drafting pays at the arm's pace
