"""The goodput rule (specmesh/core/goodput.py) and the verify cost model (core/costmodel.py),
with hand-built costs and acceptance rates."""

from __future__ import annotations

import pytest

from specmesh.core.costmodel import VerifyCost
from specmesh.core.goodput import KPolicy, RateBook, best_k, expected_tokens


def test_expected_tokens_multiplies_conditional_rates():
    assert expected_tokens([0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.9], 3) == pytest.approx(1.9)  # untried positions count as never accepted


def test_free_verify_takes_every_accepted_position_and_k0_wins_when_verify_costs():
    flat = lambda q: 1.0  # noqa: E731 - verifying is free: any useful position pays
    assert best_k([0.8, 0.6, 0.4, 0.0], flat, 4)[0] == 3  # a position never accepted adds nothing
    steep = lambda q: 1.0 + 0.5 * (q - 1)  # noqa: E731 - each position costs half a step
    assert best_k([0.3, 0.2, 0.1], steep, 3) == (0, pytest.approx(1.0))  # 1.3 / 1.5 < 1: off
    assert best_k([0.9, 0.9, 0.9], steep, 3)[0] == 3  # (1 + .9 + .81 + .729) / 2.5 = 1.38


def test_loaded_target_turns_speculation_off():
    """The same acceptance pays at batch 1 and not at batch 16, where verify rows cost compute."""
    cost = VerifyCost({1: 0.040, 2: 0.042, 5: 0.050, 16: 0.100, 32: 0.180, 80: 0.440})
    rates = [0.6, 0.4, 0.3, 0.2]
    assert best_k(rates, cost.estimate, 4)[0] >= 2
    # beside 15 others, one token each: a longer step delays all 16
    assert best_k(rates, lambda q: cost.estimate(15 + q), 4, others=15)[0] == 0
    # counted as if alone, the same draft would look worth it
    assert best_k(rates, lambda q: cost.estimate(15 + q), 4)[0] >= 1


def test_policy_learns_switches_off_and_probes_back():
    cost = lambda q: 1.0 + 0.3 * (q - 1)  # noqa: E731
    p = KPolicy(k_max=4, seed=[0.8, 0.7, 0.6, 0.5], probe_every=4)
    assert p.choose(cost) >= 2
    for _ in range(30):  # the text stops copying its context: every draft rejected
        k = p.choose(cost)
        p.update(k, 0)
    assert p.k == 0 and p.rates[0] < 0.1  # EMA of rejections (probe rounds keep measuring it)
    ks = [p.choose(cost) for _ in range(8)]
    assert ks.count(1) == 2 and ks.count(0) == 6  # every 4th round probes one position
    for _ in range(40):  # and it copies again: probes are accepted, the rate climbs back
        k = p.choose(cost)
        p.update(k, k)
    assert p.k >= 1 and sum(p.history.values()) == p.rounds


def test_hysteresis_keeps_k_within_the_margin():
    cost = lambda q: 1.0 + 0.1 * (q - 1)  # noqa: E731
    p = KPolicy(k_max=3, seed=[0.5, 0.5, 0.5], margin=0.5, probe_every=0)
    first = p.choose(cost)
    p.rates = [0.55, 0.45, 0.5]  # a small change: the goodput moves less than the margin
    assert p.choose(cost) == first


def test_limit_caps_k_and_update_ignores_untried_positions():
    p = KPolicy(k_max=4, seed=[0.9] * 4, probe_every=0)
    assert p.choose(lambda q: 1.0, limit=2) == 2
    p.update(drafted=4, accepted=1)  # position 1 accepted, 2 rejected, 3-4 untried
    assert p.rates[0] > 0.9 and p.rates[1] < 0.9 and p.rates[2:] == [0.9, 0.9]


def test_cost_model_interpolates_observes_and_round_trips():
    c = VerifyCost({1: 0.04, 5: 0.06, 17: 0.13})
    assert c.estimate(1) == pytest.approx(0.04) and c.estimate(3) == pytest.approx(0.05) and c.estimate(33) > 0.13
    c.observe(5, 0.16, batch=4)  # an EMA step at the nearest bucket
    assert 0.06 < c.estimate(5) < 0.16 and c.mean_batch > 1
    c.observe(100, 1.0)  # far from every bucket: no table change
    assert sorted(c.table) == [1, 5, 17]
    again = VerifyCost.from_dict(c.as_dict())
    assert again.table == c.table and again.mean_batch == c.mean_batch
    assert VerifyCost().estimate(3) == 3.0  # nothing known: one unit per row


def test_target_engine_measures_its_cost_model_at_start_and_returns_the_pool():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specmesh.core.costmodel import ROWS
    from target_worker.engine import TargetEngine

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    engine = TargetEngine(LlamaForCausalLM(cfg).eval(), 4, 4, 1000, 60, cpu_kernel=False)
    try:
        table = engine.measure_cost(context=16, repeats=1)
        assert table["rows"] == list(ROWS) and all(s > 0 for s in table["seconds"])
        assert engine.reserved_tokens() == 0  # the scratch sequence's range went back
    finally:
        engine.close()


def test_cost_model_buckets_not_seen_lately_follow_the_machine():
    """1-row steps observed under load (the machine slowed by half) drag the 2-row bucket, seen only
    at start-up, along: 2 rows never look cheaper than 1."""
    c = VerifyCost({1: 0.050, 2: 0.052, 5: 0.058})
    for _ in range(40):
        c.observe(1, 0.075)
    assert c.estimate(1) == pytest.approx(0.075, rel=0.02)
    assert c.estimate(2) > c.estimate(1) and c.estimate(5) > c.estimate(2)


def test_round_policy_for_a_tree_request():
    from coordinator.roundpolicy import RoundPolicy
    from specmesh.core.types import DraftProposal

    book = RateBook(alpha=0.5)
    cost = {"rows": [1, 9], "seconds": [1.0, 1.1], "mean_batch": 1.0}
    rp = RoundPolicy(k_max=8, rate_book=book, tree_budget=8)
    assert rp.k("block", 4, limit=50) == 4  # no cost model yet: fixed, the depth cap
    rp.take_cost(cost)
    assert rp.k("block", 4, limit=50) == 4 and rp.k("block", 4, limit=2) == 2  # the tree runs (depth capped)
    assert rp.nodes == 8  # 9 rows cost 1.1 steps: the whole budget
    tree = DraftProposal([1, 2, 3], None, [-1, 0, 0])
    for _ in range(20):
        rp.learn("block", tree, accepted=0, emitted=[7])  # nothing accepted: 1 token per round
    assert rp.k("block", 4, limit=50) == 0 and rp.nodes == 0 and max(book.tree_seed("block", 8)) < 1.1
    nxt = RoundPolicy(k_max=8, rate_book=book, tree_budget=8)  # the next request starts from the book
    nxt.take_cost(cost)
    assert nxt.k("block", 4, limit=50) == 0


def test_a_slow_remote_draft_counts_in_the_round_time():
    """The same tree pays when its draft is free and not when each one waits 0.5 step for the draft
    tier: goodput counts the round the request actually waits for."""
    from coordinator.roundpolicy import RoundPolicy
    from specmesh.core.types import DraftProposal

    cost = {"rows": [1, 9], "seconds": [1.0, 1.1], "mean_batch": 1.0}
    tree = DraftProposal([1, 2, 3], None, [-1, 0, 0])
    for wait, expect in ((0.0, 4), (0.5, 0)):
        rp = RoundPolicy(k_max=8, rate_book=RateBook(), tree_budget=8)
        rp.take_cost(cost)
        for _ in range(20):
            rp.learn("block", tree, accepted=0, draft_s=wait, emitted=[9])  # ~1.4 tokens per tree round
            rp.learn("block", tree, accepted=1, draft_s=wait, emitted=[1, 9])
        rp.policies.clear()  # a fresh decision from what was learnt (the book's rate, this draft time)
        assert rp.k("block", 4, limit=50) == expect, wait


def test_k_follows_the_load_although_batch_goodputs_are_close():
    """Beside 15 others every k's goodput is within a few % of the rest (their 15 tokens dominate);
    the hysteresis margin is a share of one token, so k still drops to 0 when the load comes."""
    t = lambda rows: 1.0 + 0.05 * (rows - 1)  # noqa: E731 - each row costs 5% of a step
    p = KPolicy(k_max=4, seed=[0.3, 0.3, 0.3, 0.3], probe_every=0)
    assert p.choose(t) == 2  # alone: 1.39 tokens for 1.1 steps
    # loaded: k = 0 gives 16 / 1.75 = 9.14, k = 2 gives 16.39 / 1.85 = 8.86 (a relative 5% margin
    # would have kept k = 2)
    assert p.choose(lambda q: t(15 + q), others=15) == 0


def test_a_draft_model_waits_per_drafted_token_and_is_seeded_to_draft():
    """A draft model drafts one token per forward, so its wait grows with k: at 0.1 step per token
    and rates of 0.85 the best chain is short, where a per-round wait (a block drafter's single
    forward) of the same size would pick the longest. Before anything is measured a draft model
    starts drafting (its seed), the n-gram seed does not."""
    from coordinator.roundpolicy import RoundPolicy
    from specmesh.core.costmodel import VerifyCost
    from specmesh.core.types import DraftProposal

    book = RateBook()
    assert book.seed("draft_model", 4) == [0.8] * 4 and book.seed("ngram", 2) == [0.3, 0.5]
    cost = VerifyCost()
    cost.seed({1: 1.0, 2: 1.3, 3: 1.45, 5: 1.6, 9: 2.2})  # a CPU in float32 (docs/bench/engine.md)
    fresh = RoundPolicy(k_max=8, rate_book=book)
    fresh.take_cost(cost.as_dict())
    assert fresh.k("draft_model", 4, limit=50) >= 4
    chosen = {}
    for method in ("draft_model", "block"):
        rp = RoundPolicy(k_max=8, rate_book=RateBook())
        rp.take_cost(cost.as_dict())
        k = 4
        for _ in range(30):
            # every position accepted with rate ~0.85; the round waited 0.1 step per drafted token
            rp.learn(method, DraftProposal([1] * k), accepted=3, draft_s=0.1 * k)
            rp.learn(method, DraftProposal([1] * k), accepted=4, draft_s=0.1 * k)
        rp.policies.clear()
        chosen[method] = rp.k(method, 8, limit=50)
    assert 1 <= chosen["draft_model"] < chosen["block"], chosen


def test_beside_live_others_a_drafts_wait_costs_only_the_share_of_the_forward_it_misses():
    """The pair at concurrency 4 (docs/pair.md). Speculation pulls sequences out of step, so the
    target's mean batch falls; the live count (4) is the batch a plain step would share. A round
    that waits for its draft leaves the target to the others meanwhile, so the wait does not stall
    the forward (the rule once priced it as if it did, chose k = 0 in half the rounds, and the pair
    reached 0.86-1.07x AR): each sequence's round costs T(n q) + wait, with n the live sequences
    not waiting. Where extra rows are cheap (bf16, the c4 run's table) drafting pays beside three
    others; where each row costs its own compute (T proportional to rows) it does not; a ready
    pre-draft costs no wait."""
    from coordinator.roundpolicy import RoundPolicy
    from specmesh.core.types import DraftProposal

    bf16 = {"rows": [1, 2, 3, 5, 9, 17, 33], "seconds": [0.433, 0.385, 0.421, 0.473, 0.531, 0.695, 0.890]}
    steep = {"rows": [1, 2, 4, 8, 16, 32], "seconds": [0.4, 0.8, 1.6, 3.2, 6.4, 12.8]}
    picks = {}
    for name, table in (("bf16", bf16), ("steep", steep)):
        rp = RoundPolicy(k_max=8, rate_book=RateBook())
        rp.take_cost({**table, "mean_batch": 1.0, "live": 4})
        for _ in range(10):  # rates ~0.8 per position, 0.15 s per drafted token
            rp.learn("draft_model", DraftProposal([1, 2, 3, 4, 5]), accepted=4, draft_s=5 * 0.15)
        rp.policies.clear()
        picks[name] = (rp.k("draft_model", 8, limit=50), rp.k("draft_model", 8, limit=50, ready=8))
    assert picks["bf16"][0] >= 2  # waiting 0.3 s for two drafts while the others verify pays
    assert picks["steep"][0] == 0  # every row a full row's compute: a draft never pays beside 3 others
    assert picks["bf16"][1] >= picks["bf16"][0] and picks["steep"][1] == 0


def test_shared_cycle_puts_the_waiting_share_of_the_sequences_out_of_the_forward():
    from specmesh.core.goodput import shared_cycle_s

    def linear(rows):
        return 0.3 + 0.01 * rows

    assert shared_cycle_s(linear, 4, 3, 0.0) == pytest.approx(linear(12))  # no wait: everyone's rows
    assert shared_cycle_s(linear, 1, 3, 0.5) == pytest.approx(linear(3) + 0.5)  # alone: forward + wait
    # a wait as long as the forward: about half the sequences are in it
    got = shared_cycle_s(linear, 4, 3, 0.33)
    assert linear(6) + 0.33 < got < linear(7) + 0.33


def test_the_live_count_travels_with_the_cost_table():
    from specmesh.core.costmodel import VerifyCost
    from specmesh.rpc.convert import cost_from_pb, cost_to_pb

    sent = {"rows": [1, 5], "seconds": [0.1, 0.12], "mean_batch": 1.5, "live": 7}
    got = cost_from_pb(cost_to_pb(sent))
    assert got["live"] == 7 and VerifyCost.from_dict(got).live == 7
    assert VerifyCost.from_dict({"rows": [1], "seconds": [0.1]}).live == 0  # an older worker: unknown


def test_a_bucket_no_batch_reaches_follows_the_machine_once_not_once_per_observed_bucket():
    """The machine slows by 1.5x and seven buckets are observed so (with +-20% noise): the 65-row
    bucket, never observed, must read ~1.5x its start-up time. It read 1.5^7 = 17x before session
    11 (each observed bucket's move multiplied into it: a Zen 4 bench showed 65 rows at 16x a
    one-row step although micro-benchmarked at 2.7x)."""
    import random

    rng = random.Random(0)
    start = {1: 0.070, 2: 0.075, 3: 0.086, 5: 0.100, 9: 0.125, 17: 0.130, 33: 0.136, 65: 0.200}
    c = VerifyCost(dict(start))
    for _ in range(2000):
        rows = rng.choice([1, 2, 3, 5, 9, 17, 33])
        c.observe(rows, start[rows] * 1.5 * rng.uniform(0.8, 1.2))
    assert c.estimate(65) == pytest.approx(0.300, rel=0.1)
    assert c.estimate(33) == pytest.approx(0.204, rel=0.1)


# the Qwen2.5-Coder pair in bf16 on the Zen 4 EPYC (docs/pair.md): per-position acceptance of the
# 0.5B's drafts, a verify of up to 9 positions ~ a one-token step (0.385 s), 0.14 s per draft token
PAIR_RATES = [0.74, 0.64, 0.61, 0.67, 0.72, 0.57, 0.43, 0.31]


def flat(q: int) -> float:
    return 0.385 if q <= 9 else 0.385 * q / 9


def test_after_a_miss_a_slow_draft_model_skips_a_round_instead_of_waiting_for_its_draft():
    """Worked by hand: R = 2 ready after a hit, c = 0.74 * 0.64 * 0.74 = 0.35; no draft: 3.52
    tokens per 0.82 s = 4.3/s; drafting k = 2 now: 3.39 per 0.88 s = 3.9/s."""
    from specmesh.core.goodput import skip_beats_drafting

    assert skip_beats_drafting(PAIR_RATES, flat, k=2, draft_s=0.14, ready_after_hit=2)
    # a draft ten times cheaper is worth its wait
    assert not skip_beats_drafting(PAIR_RATES, flat, k=2, draft_s=0.014, ready_after_hit=2)
    # and without a pre-draft to hand over (nothing ready after a hit), there is nothing to skip for
    assert not skip_beats_drafting(PAIR_RATES, flat, k=2, draft_s=0.14, ready_after_hit=0)
    assert not skip_beats_drafting(PAIR_RATES, flat, k=0, draft_s=0.14, ready_after_hit=2)


def test_with_overlap_a_round_after_a_miss_skips_and_a_ready_predraft_still_drafts():
    from coordinator.roundpolicy import RoundPolicy
    from specmesh.core.types import DraftProposal

    table = {"rows": [1, 2, 3, 5, 9, 17], "seconds": [0.385, 0.385, 0.385, 0.385, 0.385, 0.48],
             "mean_batch": 1.0, "live": 1}
    picks = {}
    for overlap in (False, True):
        rp = RoundPolicy(k_max=8, rate_book=RateBook(), overlap=overlap)
        rp.take_cost(table)
        for _ in range(10):  # drafted on demand: 0.14 s per token
            rp.learn("draft_model", DraftProposal([1, 2, 3]), accepted=2, draft_s=3 * 0.14)
        rp.learn("draft_model", DraftProposal([1, 2, 3]), accepted=3, draft_s=None)  # a pre-draft: no wait
        assert rp.draft_s["draft_model"] == pytest.approx(0.14)
        assert rp.predraft_tokens("draft_model", 1) == 3  # 0.385 s of verify: 2.75 tokens drafted
        picks[overlap] = (rp.k("draft_model", 8, limit=50), rp.k("draft_model", 8, limit=50, ready=4))
    assert picks[False][0] > 0  # one round at a time, drafting now pays
    assert picks[True][0] == 0  # with pre-drafts, skipping to the next round's free draft pays more
    assert picks[True][1] > 0  # a ready pre-draft is drafted on


def test_beside_live_others_with_overlap_a_round_takes_only_what_is_drafted_already():
    """The pair at concurrency 4 (docs/pair.md): a round that waits for a draft made now misses
    the forward the other sequences start meanwhile, and the sequences fall out of step (the
    target verified one or two of the four per forward). With pre-drafts (overlap) and live
    others, a round verifies only a ready pre-draft's tokens (k <= ready; none ready: k = 0, the
    pre-draft drafting on), and a pre-draft drafts for as long as the round's forward is expected
    to take (its budget), not a fixed count. Alone, or without overlap, neither applies."""
    from coordinator.roundpolicy import RoundPolicy
    from specmesh.core.types import DraftProposal

    bf16 = {"rows": [1, 2, 3, 5, 9, 17, 33], "seconds": [0.433, 0.385, 0.421, 0.473, 0.531, 0.695, 0.890],
            "mean_batch": 1.0}

    def policy(live: int, overlap: bool) -> RoundPolicy:
        rp = RoundPolicy(k_max=8, rate_book=RateBook(), overlap=overlap)
        rp.take_cost({**bf16, "live": live})
        for _ in range(10):  # rates ~0.8 per position, 0.15 s per drafted token made on demand
            rp.learn("draft_model", DraftProposal([1, 2, 3, 4, 5]), accepted=4, draft_s=5 * 0.15)
        return rp

    rp = policy(4, overlap=True)
    assert rp.k("draft_model", 8, limit=50) == 0  # nothing drafted yet: no wait, the target's token alone
    assert rp.k("draft_model", 8, limit=50, coming=True) == 0  # one in flight: it drafts on, unwaited
    assert rp.k("draft_model", 8, limit=50, ready=3) == 3  # extra rows are cheap: all that is ready
    assert rp.k("draft_model", 8, limit=2, ready=3) <= 2
    assert rp.predraft_budget_s("draft_model", 4) == pytest.approx(rp.cost.estimate(3 + 4))
    packed = policy(4, overlap=True)
    packed.take_cost({**bf16, "live": 4, "mean_rows": 3.0})  # the others each verify 3 rows a forward
    assert packed.predraft_budget_s("draft_model", 4) == pytest.approx(packed.cost.estimate(3 * 3 + 4))
    assert rp.predraft_budget_s("ngram", 4) is None  # drafted where the context is: no pre-draft
    assert policy(4, overlap=False).k("draft_model", 8, limit=50) >= 2  # without pre-drafts: the shared price
    assert policy(4, overlap=False).predraft_budget_s("draft_model", 4) is None
    alone = policy(1, overlap=True)
    assert alone.predraft_budget_s("draft_model", 4) is None  # alone: a pre-draft of a fixed length


def test_in_force_is_the_chosen_k_without_its_probe():
    """A goodput chain's probe drafts one position more than the k in force; in_force (what an
    n-gram burst's later steps draft) leaves the probe out. Without goodput it is k itself."""
    from coordinator.roundpolicy import RoundPolicy

    rp = RoundPolicy(k_max=4, rate_book=RateBook())
    rp.take_cost({"rows": [1, 2, 5], "seconds": [1.0, 2.0, 5.0], "mean_batch": 1.0})  # a row costs a step
    ks = [rp.k("ngram", 4, limit=50) for _ in range(16)]
    assert set(ks) == {0, 1} and ks.count(1) == 2  # k = 0 in force, every 8th round probes k = 1
    assert all(rp.in_force("ngram", k) == 0 for k in ks)
    assert RoundPolicy(k_max=0).in_force("ngram", 3) == 3  # fixed k


def test_cost_model_buckets_observed_in_different_minutes_keep_their_shape():
    """A noisy machine: 1-row steps observed while it runs 1.6x slow, then 5-row verifies while it
    runs at speed. One EMA per bucket held 1 row dearer than 5 (drafts looked free); the shared
    drift keeps 5 rows ~1.2x 1 row, at the speed of the latest minute."""
    c = VerifyCost({1: 0.040, 2: 0.040, 5: 0.048, 9: 0.064})
    for _ in range(30):
        c.observe(1, 0.040 * 1.6)
    for _ in range(30):
        c.observe(5, 0.048)
    assert c.estimate(5) / c.estimate(1) == pytest.approx(1.2, rel=0.1)
    assert c.estimate(1) == pytest.approx(0.040, rel=0.1)  # the machine is at speed again
    assert c.estimate(9) / c.estimate(5) == pytest.approx(0.064 / 0.048, rel=0.05)


def test_cost_model_shape_learns_a_bucket_the_start_up_got_wrong():
    """Interleaved observations at one speed, 5 rows steadily 1.5x its start-up time relative to
    1 row: the shape moves to it, the drift stays."""
    c = VerifyCost({1: 0.040, 5: 0.048})
    for _ in range(300):
        c.observe(1, 0.040)
        c.observe(5, 0.072)
    assert c.estimate(5) == pytest.approx(0.072, rel=0.05) and c.estimate(1) == pytest.approx(0.040, rel=0.05)


def test_cost_model_estimates_never_fall_with_rows():
    from specmesh.core.costmodel import monotone

    assert monotone([3.0, 1.0, 2.0, 5.0]) == [2.0, 2.0, 2.0, 5.0]
    assert monotone([1.0, 2.0]) == [1.0, 2.0] and monotone([]) == []
    c = VerifyCost({1: 0.0685, 2: 0.0591, 3: 0.0612, 5: 0.0629, 9: 0.093})  # a session-19 table
    est = [c.estimate(q) for q in range(1, 10)]
    assert est == sorted(est)


def test_the_others_rows_are_what_they_recently_packed_not_one_each():
    """4 sequences on a CPU whose forward is the weight stream up to ~5 rows and arithmetic past it.
    Priced beside 3 others at one row each, a draft accepted at 0.35 looks like the 4 -> 5-row step
    (+2%) and pays; but every sequence drafts, the target packs 2 rows each, and the real step is
    7 -> 8 rows: the draft must then be accepted at ~0.5 to pay, so k = 0. Alone, nothing changes."""
    from coordinator.roundpolicy import RoundPolicy

    curve = {"rows": [1, 2, 3, 5, 9, 17], "seconds": [0.040, 0.040, 0.042, 0.044, 0.064, 0.104]}
    seed = [0.35] + [0.1] * 7

    def k_at(**load):
        rp = RoundPolicy(k_max=8, rate_book=RateBook())
        rp.take_cost({**curve, **load})
        rp.rate_book._rates["ngram"] = list(seed)
        return rp.k("ngram", 4, limit=50)

    assert k_at(mean_batch=4.0, live=4, mean_rows=1.0, mean_tokens=1.0) == 1  # the others at one row: draft
    assert k_at(mean_batch=4.0, live=4, mean_rows=2.0, mean_tokens=1.35) == 0  # they draft too: do not
    assert k_at(mean_batch=1.0, live=1, mean_rows=2.0, mean_tokens=1.35) == 1  # alone: the same as before


def test_the_cost_model_tracks_rows_and_tokens_per_sequence():
    from specmesh.rpc.convert import cost_from_pb, cost_to_pb

    c = VerifyCost({1: 0.04, 9: 0.06})
    for _ in range(60):
        c.observe(8, 0.05, batch=4, tokens=6)  # 4 sequences, 2 rows and 1.5 tokens each
    assert c.mean_rows == pytest.approx(2.0, rel=0.01) and c.mean_tokens == pytest.approx(1.5, rel=0.01)
    back = cost_from_pb(cost_to_pb(c.as_dict()))
    assert back["mean_rows"] == pytest.approx(2.0, rel=0.01) and back["mean_tokens"] == pytest.approx(1.5, rel=0.01)
    # a worker that sends neither (older, or nothing observed): one row and one token each
    legacy = cost_to_pb(c.as_dict())
    legacy.ClearField("mean_rows"), legacy.ClearField("mean_tokens")
    assert cost_from_pb(legacy)["mean_rows"] == 1.0 and cost_from_pb(legacy)["mean_tokens"] == 1.0
