"""Decode bursts (VerifyRequest.decode_steps): an AR round that asks for n tokens gets the same
tokens as n rounds of one, batched with the other bursts step by step; a full KV pool ends a burst
early, never fails it; a burst brings every step's features; a chain draft or a draft tree is
verified in a burst's first step; a burst past the limit is refused."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specmesh.core.types import DraftProposal, SamplingParams
from specmesh.errors import InvalidArgument

PROMPTS = [[10, 11, 12], [20, 21, 22, 23], [30, 31]]
GREEDY = SamplingParams(temperature=0.0)


def _engine(model, max_tokens=4096):
    from target_worker.engine import TargetEngine

    return TargetEngine(model, 8, 8, max_tokens, 60.0, batch_invariant=True)


def _one_by_one(model, n: int) -> list[list[int]]:
    engine = _engine(model)
    try:
        out = []
        for i, p in enumerate(PROMPTS):
            toks = [engine.prefill(f"s{i}", p, GREEDY)]
            for _ in range(n):
                toks += engine.verify(f"s{i}", DraftProposal([])).tokens
            out.append(toks)
        return out
    finally:
        engine.close()


def test_bursts_equal_single_steps_and_batch_together(target_model):
    expected = _one_by_one(target_model, 8)
    engine = _engine(target_model)
    try:
        firsts = [engine.prefill(f"s{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        engine.last_batch_sizes.clear()

        def eight(i: int) -> list[int]:  # bursts of up to 4 (fewer when another job waits) until 8 tokens
            toks: list[int] = []
            while len(toks) < 8:
                out = engine.verify(f"s{i}", DraftProposal([]), steps=min(4, 8 - len(toks)))
                assert out.accepted == 0 and 1 <= len(out.tokens) <= 4
                toks += out.tokens
            return toks

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(eight, range(len(PROMPTS))))
        for i in range(len(PROMPTS)):
            assert [firsts[i]] + got[i] == expected[i]
            assert engine.cache_length(f"s{i}") == len(PROMPTS[i]) + 8
        assert max(engine.last_batch_sizes) > 1  # the concurrent bursts shared forwards
        alone = engine.verify("s0", DraftProposal([]), steps=4)  # nobody else waits: the whole burst
        assert alone.tokens == _one_by_one(target_model, 12)[0][9:13]
    finally:
        engine.close()


def test_a_full_pool_ends_a_burst_early(target_model):
    engine = _engine(target_model, max_tokens=16)
    try:
        engine.prefill_outcome("a", PROMPTS[0], GREEDY, max_new_tokens=1)
        out = engine.verify("a", DraftProposal([]), steps=40)
        assert 1 <= len(out.tokens) < 40  # as many as the pool held, then the caller asks again
    finally:
        engine.close()


def test_a_chain_draft_is_verified_in_the_first_step_of_a_burst(target_model):
    """steps with a chain draft: the first step verifies it (accepted + 1 tokens), then one-token
    steps; the tokens are those of the same rounds one call each."""
    expected = _one_by_one(target_model, 12)[0]  # [first, t1, t2, ...]
    engine = _engine(target_model)
    try:
        assert engine.prefill("a", PROMPTS[0], GREEDY) == expected[0]
        right = engine.verify("a", DraftProposal(expected[1:3]), steps=4)  # both drafts right
        assert right.accepted == 2 and right.bonus and right.tokens == expected[1:7]  # 3 + 3 steps
        wrong = engine.verify("a", DraftProposal([expected[7], (expected[8] + 1) % 100]), steps=3)
        assert wrong.accepted == 1 and not wrong.bonus and wrong.tokens == expected[7:11]  # 2 + 2 steps
        assert engine.cache_length("a") == len(PROMPTS[0]) + 10
    finally:
        engine.close()


def test_a_burst_drafts_by_prompt_lookup_and_emits_what_single_steps_do(target_model):
    """VerifyRequest.ngram_burst: after the first step each step drafts by prompt lookup over the
    sequence's own tokens and verifies it; the tokens are the one-step rounds' (greedy), the steps
    are reported, and the burst stops at max_tokens."""
    from specmesh.core.types import NgramBurst

    prompt = list(range(300, 320)) * 3  # a pattern the model continues: lookups find it
    engine = _engine(target_model)
    try:
        expected = [engine.prefill("ref", prompt, GREEDY)]
        for _ in range(24):
            expected += engine.verify("ref", DraftProposal([])).tokens
        assert engine.prefill("a", prompt, GREEDY) == expected[0]
        got, steps = [], []
        while len(got) < 20:
            out = engine.verify("a", DraftProposal([]), steps=4, ngram=NgramBurst(4, 1, 4, max_tokens=20 - len(got)))
            assert len(out.steps) <= 4 and sum(a + 1 for _, a in out.steps) == len(out.tokens)
            got, steps = got + out.tokens, steps + out.steps
        assert expected[1:21] == got  # exactly max_tokens, the target's own tokens
        assert sum(a for _, a in steps) >= 5 and len(steps) < 20  # the lookups drafted and were accepted
        assert engine.cache_length("a") == len(prompt) + 20
        with pytest.raises(InvalidArgument, match="ngram_burst"):
            engine.verify("a", DraftProposal([]), steps=2, ngram=NgramBurst(4, 3, 2, max_tokens=8))
    finally:
        engine.close()


def test_bursts_are_refused_past_the_limit(target_model):
    engine = _engine(target_model)
    try:
        engine.prefill("a", PROMPTS[0], GREEDY)
        for steps in (65, 0):
            with pytest.raises(InvalidArgument, match="decode_steps"):
                engine.verify("a", DraftProposal([]), steps=steps)
    finally:
        engine.close()


def test_a_tree_is_verified_in_the_first_step_of_a_burst_with_its_path_features(target_model):
    """steps with a draft tree: the first step verifies the tree (its accepted path + the target's
    token), then one-token steps; the tokens are the target alone's, the cache keeps the path, and
    the features are those of the same tree round followed by single steps, slot for slot."""
    import torch

    from specmesh.core.types import FeatureSpec

    spec = FeatureSpec((1, 14), max_rows=4)
    expected = _one_by_one(target_model, 12)[0]  # [first, t1, t2, ...]
    # root -> t1 (right) -> t2 (right) and a wrong sibling of each; a wrong child of the wrong root
    tree = DraftProposal([(expected[1] + 1) % 100, expected[1], (expected[2] + 1) % 100, expected[2], 7],
                         parents=[-1, -1, 1, 1, 0])
    engine = _engine(target_model)
    try:
        for seq in ("one", "burst"):
            assert engine.prefill_outcome(seq, PROMPTS[0], GREEDY, features=spec).token == expected[0]
        rounds = [engine.verify("one", tree, features=spec)] + [
            engine.verify("one", DraftProposal([]), features=spec) for _ in range(3)]
        burst = engine.verify("burst", tree, features=spec, steps=4)
        assert burst.accepted == 2 and burst.tokens == expected[1:7] == [t for r in rounds for t in r.tokens]
        assert burst.steps == [(5, 2), (0, 0), (0, 0), (0, 0)]
        assert engine.cache_length("burst") == engine.cache_length("one") == len(PROMPTS[0]) + 6
        assert burst.features.shape[0] == 6  # [pending, t1, t2] of the tree's step, then one a step
        assert torch.equal(burst.features, torch.cat([r.features for r in rounds]))
        # the cache holds the path: the next plain step is the target alone's
        assert engine.verify("burst", DraftProposal([])).tokens == expected[7:8]
    finally:
        engine.close()


def test_a_burst_stops_at_the_context_window(target_model):
    """A burst whose first step verifies a draft never writes a later step's token past the model's
    context window (the draft's accepted path counts), and its tokens are the target alone's."""
    expected = _one_by_one(target_model, 12)[0]
    engine = _engine(target_model)
    try:
        engine.context_window = len(PROMPTS[0]) + 5  # slots 0..7
        assert engine.prefill("a", PROMPTS[0], GREEDY) == expected[0]
        tree = DraftProposal([expected[1], expected[2]], parents=[-1, 0])  # both right: 3 tokens a step
        out = engine.verify("a", tree, steps=10)
        assert out.tokens == expected[1:6] and engine.cache_length("a") == engine.context_window
    finally:
        engine.close()


def test_a_burst_brings_the_features_of_every_step(target_model):
    import torch

    from specmesh.core.types import FeatureSpec

    spec = FeatureSpec((1, 14), max_rows=4)
    engine = _engine(target_model)
    try:
        engine.prefill_outcome("a", PROMPTS[1], GREEDY, features=spec)
        steps = [engine.verify("a", DraftProposal([]), features=spec) for _ in range(3)]
        engine.prefill_outcome("b", PROMPTS[1], GREEDY, features=spec)
        burst = engine.verify("b", DraftProposal([]), features=spec, steps=3)
        assert burst.tokens == [t for s in steps for t in s.tokens]
        assert burst.features.shape[0] == 3  # one committed slot a step
        assert torch.equal(burst.features, torch.cat([s.features for s in steps]))
    finally:
        engine.close()


def test_a_round_joins_a_running_burst_and_is_answered_after_its_own_step(target_model):
    """Step-level batching: a verify round that arrives while another sequence's burst runs joins
    the burst's next forward and is answered right after it; the burst is not cut short."""
    import threading

    expected = _one_by_one(target_model, 12)
    engine = _engine(target_model)
    try:
        firsts = [engine.prefill(f"s{i}", p, GREEDY) for i in range(2) for p in [PROMPTS[i]]]
        assert firsts == [expected[0][0], expected[1][0]]
        started, ended = threading.Event(), {}
        orig = engine._verify_step

        def step(jobs, hidden=()):  # the burst's first forward has begun: now send the round
            started.set()
            return orig(jobs, hidden)

        engine._verify_step = step

        def burst():
            out = engine.verify("s0", DraftProposal([]), steps=12)
            ended["burst"] = time.monotonic()
            return out

        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(burst)
            assert started.wait(30)
            round_ = engine.verify("s1", DraftProposal([expected[1][1], 7]))  # one right, one wrong draft
            answered = time.monotonic()
            out = fut.result(60)
        assert round_.tokens == expected[1][1:3] and round_.accepted == 1
        assert out.tokens == expected[0][1:13]  # all 12 steps: the round did not cut the burst short
        assert answered < ended["burst"]  # answered while the burst still ran
        assert max(engine.last_batch_sizes) == 2  # the round shared a forward with the burst
    finally:
        engine.close()


def test_a_prefill_runs_between_a_bursts_steps_and_the_burst_goes_on(target_model):
    """A new request's prefill that arrives while a burst runs is run between two of its steps;
    the burst keeps all its steps (it used to end early, its caller asking again) and both emit
    what they emit alone."""
    import threading

    expected = _one_by_one(target_model, 12)
    engine = _engine(target_model)
    try:
        assert engine.prefill("s0", PROMPTS[0], GREEDY) == expected[0][0]
        started, steps, prefilled = threading.Event(), [], {}
        orig = engine._verify_step

        def step(jobs, hidden=()):
            started.set()
            steps.append(time.monotonic())
            return orig(jobs, hidden)

        engine._verify_step = step
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(engine.verify, "s0", DraftProposal([]), None, None, 12)
            assert started.wait(30)
            first = engine.prefill("s1", PROMPTS[1], GREEDY)
            prefilled["at"] = time.monotonic()
            out = fut.result(60)
        assert first == expected[1][0]
        assert out.tokens == expected[0][1:13]  # all 12 steps in one call
        assert steps[0] < prefilled["at"] < steps[-1]  # the prefill ran between the burst's steps
        assert engine.verify("s1", DraftProposal([]), steps=4).tokens == expected[1][1:5]
    finally:
        engine.close()


def test_a_bursts_lookups_draft_by_the_length_of_their_match(target_model):
    """NgramBurst.by_match: a step whose lookup matched n tokens drafts the k of the last bucket
    with min_match <= n (none below the first bucket), and the tokens stay the target's own."""
    from specmesh.core.ngram import lookup_ngram
    from specmesh.core.types import MatchBucket, NgramBurst

    prompt = list(range(300, 320)) * 3  # every later step matches the whole pattern (>= 8 tokens)
    engine = _engine(target_model)
    try:
        expected = [engine.prefill("ref", prompt, GREEDY)]
        for _ in range(20):
            expected += engine.verify("ref", DraftProposal([])).tokens
        runs = {}
        for name, buckets in (("long", (MatchBucket(1, 0), MatchBucket(8, 3))),
                              ("short", (MatchBucket(1, 1), MatchBucket(8, 0))),
                              ("above", (MatchBucket(9, 4),))):  # max_n 8: never reached
            assert engine.prefill(name, prompt, GREEDY) == expected[0]
            spec = NgramBurst(4, 1, 8, max_tokens=40, by_match=buckets)  # 4 steps emit at most 16
            out = engine.verify(name, DraftProposal([]), steps=4, ngram=spec)
            assert out.tokens == expected[1:1 + len(out.tokens)]
            runs[name] = [d for d, _ in out.steps[1:]]
        assert lookup_ngram(prompt + expected[:2], 4, 1, 8)[0] == 8
        assert runs["long"] and all(d == 3 for d in runs["long"])
        assert runs["short"] and all(d == 0 for d in runs["short"])
        assert runs["above"] and all(d == 0 for d in runs["above"])
        with pytest.raises(InvalidArgument, match="ngram_burst.by_match"):
            engine.verify("long", DraftProposal([]), steps=2,
                          ngram=NgramBurst(4, 1, 8, 8, by_match=(MatchBucket(2, 1), MatchBucket(1, 1))))
    finally:
        engine.close()
