"""The target worker trims chain drafts beside others (target_worker/steps.py, core/trim.py): the
trimmed round is still the target alone's output, reports what it verified and what it cut, and
the wire refuses bad p_i."""

from __future__ import annotations

import pytest

from specmesh.core.costmodel import VerifyCost
from specmesh.core.types import DraftProposal, NgramBurst, SamplingParams
from specmesh.errors import InvalidArgument

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[10, 11, 12], [20, 21, 22, 23]]


def _engine(model, trim: bool = True):
    from target_worker.engine import TargetEngine

    return TargetEngine(model, 8, 8, 4096, 60.0, batch_invariant=True, draft_trim=trim)


def _greedy(model, n: int) -> list[list[int]]:
    """Each prompt's first n + 1 tokens from the target alone (one-token rounds)."""
    from tests.unit.test_decode_burst import PROMPTS as SAME, _one_by_one

    assert SAME[:2] == PROMPTS
    return _one_by_one(model, n)[:2]


def _round(engine, drafts: list[DraftProposal]):
    """One verify step of both sequences in one forward (the model thread's own entry)."""
    from target_worker.steps import VerifyJob

    jobs = [VerifyJob(engine._seqs[f"s{i}"], d) for i, d in enumerate(drafts)]
    for job in jobs:
        job.seq.inflight = True
    try:
        return engine._run_verify(jobs)
    finally:
        for job in jobs:
            job.seq.inflight = False


@pytest.mark.parametrize("cost, kept", [({1: 0.01, 2: 0.02, 9: 0.09}, 0), ({1: 0.01, 9: 0.0100001}, 3)])
def test_a_trimmed_round_is_the_target_alones(target_model, cost, kept):
    expected = _greedy(target_model, 4)
    engine = _engine(target_model)
    try:
        for i, p in enumerate(PROMPTS):
            assert engine.prefill(f"s{i}", p, GREEDY) == expected[i][0]
        engine.cost = VerifyCost(cost)  # dear rows: every draft cut; nearly free: all kept
        drafts = [DraftProposal(expected[i][1:4], accept=[0.3, 0.2, 0.1]) for i in range(2)]
        outs = _round(engine, drafts)
        for i, out in enumerate(outs):
            assert out.tokens == expected[i][1:2 + kept]  # the greedy drafts: all accepted when verified
            assert out.steps[0] == (kept, kept) and out.trimmed == 3 - kept
            assert engine.cache_length(f"s{i}") == len(PROMPTS[i]) + 1 + kept
        assert engine.trimmed_tokens == 2 * (3 - kept)
    finally:
        engine.close()


def test_alone_or_without_p_nothing_is_trimmed(target_model):
    engine = _engine(target_model)
    try:
        for i, p in enumerate(PROMPTS):
            engine.prefill(f"s{i}", p, GREEDY)
        engine.cost = VerifyCost({1: 0.01, 2: 0.02, 9: 0.09})
        outs = _round(engine, [DraftProposal([5, 6]), DraftProposal([7, 8])])  # no p: a request's own k
        assert [o.steps[0][0] for o in outs] == [2, 2] and not any(o.trimmed for o in outs)
        one = engine.verify("s0", DraftProposal([5, 6], accept=[0.01, 0.001]))  # alone: the coordinator's k stands
        assert one.steps[0][0] == 2 and one.trimmed == 0
    finally:
        engine.close()


def test_the_wire_refuses_bad_p():
    from specmesh.rpc.convert import ngram_burst_from_pb, proposal_from_pb
    from specmesh.v1 import specmesh_pb2 as pb

    ok = proposal_from_pb([1, 2], b"", 0, accept=[0.5, 0.25])
    assert ok.accept == [0.5, 0.25] and ok.head(1).accept == [0.5] and ok.head(1).token_ids == [1]
    for bad, kw in (([0.5], {}), ([0.5, 1.5], {}), ([float("nan"), 0.1], {}), ([0.5, 0.2], {"parents": [-1, 0]})):
        with pytest.raises(InvalidArgument, match="draft_accept"):
            proposal_from_pb([1, 2], b"", 0, accept=bad, **kw)
    req = pb.VerifyRequest(ngram_burst=pb.NgramBurst(k=2, min_n=1, max_n=2, max_tokens=8, rates=[0.5, 0.4]))
    assert ngram_burst_from_pb(req) == NgramBurst(2, 1, 2, 8, (pytest.approx(0.5), pytest.approx(0.4)))
    req.ngram_burst.rates.append(-0.1)
    with pytest.raises(InvalidArgument, match="ngram_burst.rates"):
        ngram_burst_from_pb(req)
