"""coordinator.loop.Generation against hand-written fake tiers (TargetClient / DraftPool protocols).

The fake target "knows" a fixed greedy continuation (SCRIPT); verify accepts drafted tokens while
they match it and appends the next script token, like chain verification at T=0.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from coordinator.loop import Chunk, Generation
from specmesh.core.types import DraftProposal, GenerationRequest, SamplingParams, VerifyOutcome
from specmesh.errors import Cancelled, DeadlineExceeded, InvalidArgument, Unavailable

EOS = 99
PROMPT = [1, 2, 3]
SCRIPT = [(i % 20) + 1 for i in range(200)]  # the target's greedy continuation; never EOS


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join("" if i == EOS else chr(ord("a") + (i - 1) % 26) for i in ids)


class FakeTarget:
    def __init__(self, script=SCRIPT, fail_on_verify: int | None = None, verify_sleep: float = 0.0):
        self.script = list(script)
        self.fail_on_verify = fail_on_verify
        self.verify_sleep = verify_sleep
        self.emitted: dict[str, int] = {}
        self.prefills: list[tuple[str, list[int], float]] = []
        self.verifies: list[tuple[str, list[int], float]] = []
        self.released: list[str] = []

    def prefill(self, seq_id, prompt, params, timeout, max_new_tokens=0):
        self.prefills.append((seq_id, list(prompt), timeout))
        self.emitted[seq_id] = 1
        return self.script[0]

    def verify(self, seq_id, draft, timeout):
        self.verifies.append((seq_id, list(draft.token_ids), timeout))
        if self.verify_sleep:
            time.sleep(self.verify_sleep)
        if self.fail_on_verify is not None and len(self.verifies) == self.fail_on_verify:
            raise Unavailable("target worker went away")
        p = self.emitted[seq_id]
        n = 0
        while n < len(draft.token_ids) and draft.token_ids[n] == self.script[p + n]:
            n += 1
        tokens = list(draft.token_ids[:n]) + [self.script[p + n]]
        self.emitted[seq_id] = p + len(tokens)
        return VerifyOutcome(n, tokens, bonus=n == len(draft.token_ids))

    def release(self, seq_id):
        self.released.append(seq_id)


class FakeDrafts:
    """Proposes the script (perfect drafter), or wrong tokens, or fails, per round."""

    def __init__(self, script=SCRIPT, fail=lambda round_: False, wrong_after: int | None = None,
                 exc=Unavailable("draft worker down"), extra: int = 0):
        self.script = list(script)
        self.fail = fail
        self.wrong_after = wrong_after  # draft positions >= this are wrong
        self.exc = exc
        self.extra = extra  # propose this many tokens more than asked
        self.calls: list[dict] = []
        self.released: list[str] = []

    def propose(self, seq_id, context, k, method, params, round_, timeout, calls=None, budget_s=0.0):
        self.calls.append(dict(seq_id=seq_id, context=list(context), k=k, method=method, round=round_,
                               timeout=timeout, budget_s=budget_s))
        if self.fail(round_):
            raise self.exc
        p = len(context) - len(PROMPT)
        toks = self.script[p:p + k + self.extra]
        if self.wrong_after is not None:
            toks = [t if i < self.wrong_after else 150 + i for i, t in enumerate(toks)]
        return DraftProposal(toks, None)

    def release(self, seq_id):
        self.released.append(seq_id)


def burst(verify_one, draft: DraftProposal, steps: int) -> tuple[VerifyOutcome, list[tuple[int, int]]]:
    """A fake target's decode burst: verify_one(draft) in the first step, then steps - 1 plain
    steps; their tokens (and features, where the steps return them) joined. -> (outcome, the
    (drafted, accepted) of each step)."""
    out = verify_one(draft)
    done = [(len(draft.token_ids), out.accepted)]
    for _ in range(steps - 1):
        more = verify_one(DraftProposal([]))
        feats = None if out.features is None else torch.cat([out.features, more.features])
        out = dataclasses.replace(out, tokens=out.tokens + more.tokens, features=feats)
        done.append((0, 0))
    return out, done


def request(max_tokens=10, k=4, method="ngram", stop=(), deadline=None):
    return GenerationRequest(list(PROMPT), max_tokens, SamplingParams(), method, k, tuple(stop), deadline,
                             request_id="req-1")


def generation(req, target, drafts, is_active=lambda: True, draft_timeout_s=5.0):
    return Generation(req, target, drafts, FakeTokenizer(), {EOS}, draft_timeout_s, is_active)


def run_all(gen) -> list[Chunk]:
    return list(gen.run())


def expected_text(ids):
    return FakeTokenizer().decode(ids)


# ------------------------------------------------------------------------------------ happy path

def test_perfect_drafter_output_and_stats():
    target, drafts = FakeTarget(), FakeDrafts()
    gen = generation(request(max_tokens=11, k=4), target, drafts)
    chunks = run_all(gen)
    assert gen.out.token_ids == SCRIPT[:11]
    assert gen.out.finish_reason == "length"
    assert [c.token_ids for c in chunks] == [SCRIPT[:1], SCRIPT[1:6], SCRIPT[6:11]]
    assert "".join(c.text for c in chunks) == expected_text(SCRIPT[:11]) == gen.out.text
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    s = gen.stats
    assert (s.rounds, s.drafted_tokens, s.accepted_tokens, s.draft_failures) == (2, 8, 8, 0)
    assert s.mean_acceptance_length == 5.0
    assert s.accepted_per_position == [2, 2, 2, 2]
    assert gen.ttft_s is not None and gen.ttft_s >= 0


def test_rejected_drafts_still_give_target_output():
    target, drafts = FakeTarget(), FakeDrafts(wrong_after=1)
    gen = generation(request(max_tokens=9, k=3), target, drafts)
    run_all(gen)
    assert gen.out.token_ids == SCRIPT[:9]
    assert gen.stats.accepted_tokens == gen.stats.rounds  # one of three accepted per round
    # every round but the clamped last one drafts k = 3
    assert [len(d) for _, d, _ in target.verifies] == [3, 3, 3, 1]
    assert gen.stats.drafted_tokens == 10


def test_draft_context_is_prompt_plus_output_and_rounds_counted():
    target, drafts = FakeTarget(), FakeDrafts()
    gen = generation(request(max_tokens=11, k=4), target, drafts)
    run_all(gen)
    assert [c["round"] for c in drafts.calls] == [0, 1]
    assert drafts.calls[0]["context"] == PROMPT + SCRIPT[:1]
    assert drafts.calls[1]["context"] == PROMPT + SCRIPT[:6]
    assert all(c["method"] == "ngram" and c["seq_id"] == gen.seq_id for c in drafts.calls)
    assert target.prefills[0][1] == PROMPT


def test_overlong_proposal_is_truncated_to_k():
    target, drafts = FakeTarget(), FakeDrafts(extra=3)
    gen = generation(request(max_tokens=8, k=2), target, drafts)
    run_all(gen)
    assert all(len(d) <= 2 for _, d, _ in target.verifies)
    assert gen.out.token_ids == SCRIPT[:8]


def test_eos_from_prefill_ends_without_rounds():
    target, drafts = FakeTarget(script=[EOS] + SCRIPT), FakeDrafts()
    gen = generation(request(), target, drafts)
    chunks = run_all(gen)
    assert gen.out.finish_reason == "eos" and gen.out.token_ids == [EOS]
    assert len(chunks) == 1 and target.verifies == [] and drafts.calls == []
    assert target.released == [gen.seq_id]


def test_eos_mid_round_stops_generation():
    script = SCRIPT[:5] + [EOS] + SCRIPT[5:]
    target, drafts = FakeTarget(script=script), FakeDrafts(script=script)
    gen = generation(request(max_tokens=50, k=4), target, drafts)
    run_all(gen)
    assert gen.out.finish_reason == "eos"
    assert gen.out.token_ids == script[:6]


def test_stop_string_ends_generation():
    target, drafts = FakeTarget(), FakeDrafts()
    stop = expected_text(SCRIPT[4:6])  # "ef"
    gen = generation(request(max_tokens=50, k=4, stop=(stop,)), target, drafts)
    chunks = run_all(gen)
    assert gen.out.finish_reason == "stop"
    assert gen.out.text == expected_text(SCRIPT[:4])
    assert "".join(c.text for c in chunks) == gen.out.text
    assert gen.out.token_ids == SCRIPT[:6]


def test_method_off_never_calls_drafts():
    target, drafts = FakeTarget(), FakeDrafts()
    gen = generation(request(max_tokens=6, k=0, method="off"), target, drafts)
    run_all(gen)
    assert gen.method == "off"
    assert drafts.calls == [] and drafts.released == []
    assert [d for _, d, _ in target.verifies] == [[]] * 5
    assert gen.out.token_ids == SCRIPT[:6]


def test_no_draft_pool_means_off():
    target = FakeTarget()
    gen = generation(request(max_tokens=4, k=4), target, None)
    run_all(gen)
    assert gen.method == "off"
    assert gen.out.token_ids == SCRIPT[:4]
    assert target.released == [gen.seq_id]


# ------------------------------------------------------------------------------------ draft failures

def test_draft_failure_request_completes_with_k0_rounds():
    target, drafts = FakeTarget(), FakeDrafts(fail=lambda r: True)
    gen = generation(request(max_tokens=8, k=4), target, drafts)
    chunks = run_all(gen)
    assert gen.out.finish_reason == "length"
    assert gen.out.token_ids == SCRIPT[:8]  # same output as the target alone
    assert "".join(c.text for c in chunks) == expected_text(SCRIPT[:8])
    assert [d for _, d, _ in target.verifies] == [[]] * 7  # every round ran with k = 0
    s = gen.stats
    assert s.rounds == 7
    assert s.draft_failures == 6 == len(drafts.calls)  # the last round (1 token left) asks no drafter
    assert s.drafted_tokens == 0 and s.accepted_tokens == 0
    assert target.released == [gen.seq_id]


def test_intermittent_draft_failure():
    target, drafts = FakeTarget(), FakeDrafts(fail=lambda r: r == 1)
    gen = generation(request(max_tokens=16, k=4), target, drafts)
    run_all(gen)
    assert gen.out.token_ids == SCRIPT[:16]
    assert gen.stats.draft_failures == 1
    drafted = [len(d) for _, d, _ in target.verifies]
    assert drafted[1] == 0 and drafted[0] == 4 and drafted[2] == 4


@pytest.mark.parametrize("exc", [Unavailable("down"), InvalidArgument("method", "not served"),
                                 DeadlineExceeded("draft slow")])
def test_any_draft_tier_error_is_a_draft_failure(exc):
    # a DeadlineExceeded from the draft tier while the request's own deadline is still far away
    # is a slow draft, not a failed request
    target, drafts = FakeTarget(), FakeDrafts(fail=lambda r: True, exc=exc)
    gen = generation(request(max_tokens=5, k=2, deadline=time.monotonic() + 60), target, drafts)
    run_all(gen)
    assert gen.out.token_ids == SCRIPT[:5]
    assert gen.stats.draft_failures == 3 == len(drafts.calls)


def test_draft_timeout_is_min_of_draft_timeout_and_remaining():
    target, drafts = FakeTarget(), FakeDrafts()
    gen = generation(request(max_tokens=6, k=2, deadline=time.monotonic() + 60), target, drafts,
                     draft_timeout_s=0.75)
    run_all(gen)
    assert all(c["timeout"] == 0.75 for c in drafts.calls)
    drafts = FakeDrafts()
    gen = generation(request(max_tokens=6, k=2, deadline=time.monotonic() + 0.5), FakeTarget(), drafts,
                     draft_timeout_s=30)
    run_all(gen)
    assert all(0 < c["timeout"] <= 0.5 for c in drafts.calls)


# ------------------------------------------------------------------------------------ k clamping

@pytest.mark.parametrize("max_tokens,k", [(1, 4), (2, 4), (5, 4), (6, 4), (7, 3), (10, 4), (13, 16), (3, 1)])
def test_k_clamped_so_no_round_drafts_past_max_tokens(max_tokens, k):
    target, drafts = FakeTarget(), FakeDrafts()
    gen = generation(request(max_tokens=max_tokens, k=k), target, drafts)
    run_all(gen)
    emitted = 1
    for call, (_, draft, _) in zip(drafts.calls, target.verifies):
        left = max_tokens - emitted
        assert call["k"] <= left - 1, (call["k"], left)
        assert call["k"] <= k
        assert len(draft) <= left - 1
        emitted += len(draft) + 1  # perfect drafter: all accepted + one target token
    assert gen.out.token_ids == SCRIPT[:max_tokens]
    assert gen.out.finish_reason == "length"
    assert gen.stats.emitted_tokens == max_tokens - 1  # nothing produced was thrown away
    assert all(c["k"] > 0 for c in drafts.calls)  # a k = 0 round does not call the draft tier


def test_last_round_with_one_token_left_skips_draft_tier():
    target, drafts = FakeTarget(), FakeDrafts(wrong_after=0)  # drafts always rejected
    gen = generation(request(max_tokens=3, k=4), target, drafts)
    run_all(gen)
    # after prefill 2 left -> k = 1 (rejected, 1 token), then 1 left -> k = 0 without calling drafts
    assert [c["k"] for c in drafts.calls] == [1]
    assert [len(d) for _, d, _ in target.verifies] == [1, 0]
    assert gen.out.token_ids == SCRIPT[:3]


# ------------------------------------------------------------------------------------ release

def test_release_on_finish():
    target, drafts = FakeTarget(), FakeDrafts()
    gen = generation(request(max_tokens=5), target, drafts)
    run_all(gen)
    assert target.released == [gen.seq_id]
    assert drafts.released == [gen.seq_id]


def test_release_on_target_exception():
    target, drafts = FakeTarget(fail_on_verify=2), FakeDrafts()
    gen = generation(request(max_tokens=30, k=2), target, drafts)
    with pytest.raises(Unavailable, match="target worker went away"):
        run_all(gen)
    assert target.released == [gen.seq_id]
    assert drafts.released == [gen.seq_id]


def test_release_on_prefill_exception():
    class FailingPrefill(FakeTarget):
        def prefill(self, *a, **kw):
            raise Unavailable("KV cache full")

    target = FailingPrefill()
    gen = generation(request(), target, FakeDrafts())
    with pytest.raises(Unavailable):
        run_all(gen)
    assert target.released == [gen.seq_id]


def test_release_on_cancellation():
    active = {"v": True}
    target, drafts = FakeTarget(), FakeDrafts()
    gen = generation(request(max_tokens=50, k=2), target, drafts, is_active=lambda: active["v"])
    it = gen.run()
    next(it)
    next(it)
    active["v"] = False  # client went away
    with pytest.raises(Cancelled):
        list(it)
    assert target.released == [gen.seq_id]
    assert drafts.released == [gen.seq_id]
    assert len(target.verifies) == 1  # no round after the client left


def test_inactive_from_start_releases_after_prefill():
    target = FakeTarget()
    gen = generation(request(max_tokens=50), target, FakeDrafts(), is_active=lambda: False)
    with pytest.raises(Cancelled):
        run_all(gen)
    assert target.verifies == []
    assert target.released == [gen.seq_id]


def test_release_when_consumer_abandons_iteration():
    target, drafts = FakeTarget(), FakeDrafts()
    gen = generation(request(max_tokens=50, k=2), target, drafts)
    it = gen.run()
    next(it)
    it.close()  # e.g. the servicer's generator is closed
    assert target.released == [gen.seq_id]


def test_release_failure_is_swallowed():
    class BadRelease(FakeTarget):
        def release(self, seq_id):
            super().release(seq_id)
            raise Unavailable("target gone")

    target = BadRelease()
    gen = generation(request(max_tokens=3), target, FakeDrafts())
    run_all(gen)  # no exception: the worker reclaims idle sequences itself
    assert gen.out.finish_reason == "length"
    assert target.released == [gen.seq_id]


# ------------------------------------------------------------------------------------ deadline

def test_deadline_already_passed():
    target, drafts = FakeTarget(), FakeDrafts()
    gen = generation(request(deadline=time.monotonic() - 1), target, drafts)
    with pytest.raises(DeadlineExceeded):
        run_all(gen)
    assert target.prefills == []
    assert target.released == [gen.seq_id]


def test_deadline_passes_mid_generation():
    target, drafts = FakeTarget(verify_sleep=0.1), FakeDrafts(wrong_after=0)
    gen = generation(request(max_tokens=200, k=2, deadline=time.monotonic() + 0.5), target, drafts)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        run_all(gen)
    assert time.monotonic() - t0 < 5
    assert 1 <= len(target.verifies) < 199
    assert target.released == [gen.seq_id]
    assert drafts.released == [gen.seq_id]


def test_timeouts_passed_to_target_shrink_with_deadline():
    target = FakeTarget(verify_sleep=0.02)
    gen = generation(request(max_tokens=5, k=0, method="off", deadline=time.monotonic() + 30), target, None)
    run_all(gen)
    timeouts = [target.prefills[0][2]] + [t for _, _, t in target.verifies]
    assert all(0 < t <= 30 for t in timeouts)
    assert timeouts == sorted(timeouts, reverse=True)


def test_draft_deadline_exceeded_after_request_deadline_fails_request():
    class SlowDrafts(FakeDrafts):
        def propose(self, *a, **kw):
            time.sleep(0.3)
            raise DeadlineExceeded("draft timed out")

    target, drafts = FakeTarget(), SlowDrafts()
    gen = generation(request(max_tokens=50, k=2, deadline=time.monotonic() + 0.2), target, drafts)
    with pytest.raises(DeadlineExceeded):
        run_all(gen)
    assert gen.stats.draft_failures == 0
    assert target.released == [gen.seq_id]


def test_no_deadline_gives_long_timeout():
    target = FakeTarget()
    gen = generation(request(max_tokens=2, deadline=None), target, None)
    run_all(gen)
    assert target.prefills[0][2] >= 60


def test_concurrent_generations_have_distinct_seq_ids():
    target, drafts = FakeTarget(), FakeDrafts()
    gens = [generation(request(max_tokens=12, k=3), target, drafts) for _ in range(4)]
    threads = [threading.Thread(target=run_all, args=(g,)) for g in gens]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len({g.seq_id for g in gens}) == 4
    assert all(g.out.token_ids == SCRIPT[:12] for g in gens)
    assert sorted(target.released) == sorted(g.seq_id for g in gens)


# ------------------------------------------------------------------------------------ decode bursts

class BurstTarget(FakeTarget):
    """A target that decodes `steps` tokens of its script per AR call."""

    def __init__(self):
        super().__init__()
        self.steps: list[int] = []

    def verify(self, seq_id, draft, timeout, steps=1):
        self.steps.append(steps)
        assert steps == 1 or not draft.token_ids
        return burst(lambda d: super(BurstTarget, self).verify(seq_id, d, timeout), draft, steps)[0]


def test_ar_rounds_decode_in_bursts_capped_by_max_tokens():
    target = BurstTarget()
    gen = Generation(request(max_tokens=11, method="off"), target, None, FakeTokenizer(), {EOS}, 5.0,
                     decode_steps=4)
    chunks = run_all(gen)
    assert gen.out.token_ids == SCRIPT[:11] and gen.out.finish_reason == "length"
    assert target.steps == [4, 4, 2]  # 1 from the prefill, then 10 in bursts that stop at max_tokens
    assert [len(c.token_ids) for c in chunks] == [1, 4, 4, 2]
    assert (gen.stats.rounds, gen.stats.emitted_tokens, gen.stats.mean_acceptance_length) == (10, 10, 1.0)


def test_local_ngram_rounds_without_a_match_decode_one_token():
    target = BurstTarget()
    gen = Generation(request(max_tokens=9, k=2, method="ngram"), target, None, FakeTokenizer(), {EOS}, 5.0,
                     local_drafters={"ngram": lambda context, k: []}, decode_steps=4)
    run_all(gen)
    assert gen.out.token_ids == SCRIPT[:9] and set(target.steps) == {1}


def test_speculative_rounds_never_burst():
    target, drafts = BurstTarget(), FakeDrafts(wrong_after=0)  # every draft rejected: k > 0 rounds anyway
    gen = Generation(request(max_tokens=9, k=2), target, drafts, FakeTokenizer(), {EOS}, 5.0, decode_steps=4)
    run_all(gen)
    assert gen.out.token_ids == SCRIPT[:9] and set(target.steps) == {1}


@pytest.mark.parametrize("overlap", [False, True])
def test_rounds_while_the_draft_tier_has_no_worker_run_as_the_target_alone_in_bursts(overlap):
    """A pool that says no worker may be asked now (all down for their retry time): those rounds
    send no Propose (nor a pre-draft) and decode in bursts; once a worker may be asked again,
    rounds draft again."""
    from concurrent.futures import ThreadPoolExecutor

    up = {"now": False}

    class TierDown(FakeDrafts):
        def available(self, method):
            assert method == "ngram"
            return up["now"]

    def run(drafts, target):
        with ThreadPoolExecutor(1) as pool:
            gen = Generation(request(max_tokens=9, k=2), target, drafts, FakeTokenizer(), {EOS}, 5.0, decode_steps=4,
                             overlap=pool if overlap else None)
            run_all(gen)
        return gen

    target, drafts = BurstTarget(), TierDown()
    gen = run(drafts, target)
    assert gen.out.token_ids == SCRIPT[:9] and target.steps == [4, 4] and drafts.calls == []
    assert gen.stats.draft_failures == 0 and gen.stats.chosen_k == {0: 2} and gen.stats.tier_down_rounds == 2
    up["now"] = True
    target, drafts = BurstTarget(), TierDown()
    gen = run(drafts, target)
    assert gen.out.token_ids == SCRIPT[:9] and drafts.calls and set(target.steps) == {1}


def test_grpc_pool_is_unavailable_while_every_worker_serving_the_method_is_down():
    from coordinator.draftpool import GrpcDraftPool

    pool = GrpcDraftPool(("127.0.0.1:1", "127.0.0.1:2"), retry_after_s=30.0)
    try:
        assert pool.available("block")
        members = pool.members.snapshot()
        pool.members.mark_down(members[0], 30.0)
        assert pool.available("block")
        pool.members.mark_down(members[1], 30.0)
        assert not pool.available("block")
        pool.members.mark_down(members[0], 0.0)
        assert pool.available("block")
    finally:
        for m in pool.members.snapshot():
            m.client.close()
