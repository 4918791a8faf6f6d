"""Decode bursts (VerifyRequest.decode_steps): an AR round that asks for n tokens gets the same
tokens as n rounds of one, batched with the other bursts step by step; a full KV pool ends a burst
early, never fails it; a burst brings every step's features; a burst beside a draft or past the
limit is refused."""

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


def test_bursts_are_refused_with_a_draft_or_past_the_limit(target_model):
    engine = _engine(target_model)
    try:
        engine.prefill("a", PROMPTS[0], GREEDY)
        for draft, steps in ((DraftProposal([5, 6]), 2), (DraftProposal([]), 65), (DraftProposal([]), 0)):
            with pytest.raises(InvalidArgument, match="decode_steps"):
                engine.verify("a", draft, steps=steps)
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
