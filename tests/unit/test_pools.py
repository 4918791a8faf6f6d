"""Routing in coordinator.clients / draftpool (no servers: channels are lazy) and target failover in the loop."""

from __future__ import annotations

import time
from collections import Counter

import grpc

import pytest

from coordinator.clients import GrpcTargetClient, TargetPool
from coordinator.draftpool import GrpcDraftPool
from coordinator.loop import Generation
from specmesh.core.types import DraftProposal, GenerationRequest, SamplingParams, VerifyOutcome
from specmesh.errors import InvalidArgument, NotFound, Unavailable
from specmesh.registry import WorkerRecord


def target_rec(addr, live=0, cap=8, held=0, max_tokens=10_000, draining=False):
    return WorkerRecord(f"id-{addr}", "target", addr, capacity={"max_sequences": cap, "max_tokens": max_tokens},
                        load={"live_sequences": live, "held_tokens": held}, draining=draining)


def draft_rec(addr, inflight=0, methods=("ngram",), draining=False):
    return WorkerRecord(f"id-{addr}", "draft", addr, methods=methods, load={"inflight": inflight}, draining=draining)


def test_static_target_pool_round_robins_sequential_sequences():
    pool = TargetPool(("a:1", "b:1"))
    picks = []
    for _ in range(4):
        lease = pool.pick()
        picks.append(lease.address)
        pool.members.done(lease.member)
    assert Counter(picks) == {"a:1": 2, "b:1": 2}


def test_static_target_pool_spreads_concurrent_sequences_and_excludes():
    pool = TargetPool(("a:1", "b:1", "c:1"))
    leases = [pool.pick() for _ in range(9)]
    assert Counter(lease.address for lease in leases) == {"a:1": 3, "b:1": 3, "c:1": 3}
    assert pool.pick(exclude=("a:1", "b:1")).address == "c:1"
    with pytest.raises(Unavailable):
        pool.pick(exclude=("a:1", "b:1", "c:1"))
    with pytest.raises(Unavailable, match="registered"):
        TargetPool(()).pick()


def test_registry_target_pool_prefers_free_capacity_and_skips_draining():
    pool = TargetPool()
    pool.update([target_rec("busy:1", live=6), target_rec("free:1", live=1), target_rec("drain:1", draining=True)])
    leases = [pool.pick() for _ in range(5)]  # free:1 has 7 slots vs 2: burst goes there until they even out
    assert [lease.address for lease in leases] == ["free:1"] * 5
    assert {pool.pick().address for _ in range(4)} == {"busy:1", "free:1"}
    assert "drain:1" not in {m.address for m in pool.members.candidates()}


def test_target_that_cannot_fit_the_prompt_is_last_choice():
    pool = TargetPool()
    pool.update([target_rec("small:1", held=9_990), target_rec("big:1", live=5)])
    assert pool.pick(prompt_tokens=100).address == "big:1"


def test_membership_follows_registry_and_closes_removed_after_last_lease():
    pool = TargetPool()
    pool.update([target_rec("a:1"), target_rec("b:1")])
    lease = pool.pick(exclude=("b:1",))
    pool.update([target_rec("b:1")])  # a:1 stopped heartbeating
    assert [c.address for c in pool.clients] == ["b:1"]
    assert lease.member.removed and lease.member.inflight == 1
    closed = []
    lease.client.close = lambda: closed.append(True)
    lease.client.release = lambda seq_id: None
    lease.release("s")
    lease.release("s")  # idempotent
    assert closed == [True] and lease.member.inflight == 0


def test_unavailable_marks_target_down_for_retry_after():
    pool = TargetPool(("a:1", "b:1"), retry_after_s=60)
    lease = pool.pick()

    def boom(*a):
        raise Unavailable("gone")

    lease.client.verify = boom
    with pytest.raises(Unavailable):
        lease.verify("s", DraftProposal([]), 1.0)
    assert {pool.pick().address for _ in range(3)} == {"b:1" if lease.address == "a:1" else "a:1"}


def test_draft_pool_least_loaded_method_filter_and_draining():
    pool = GrpcDraftPool()
    pool.update([draft_rec("x:1", inflight=3), draft_rec("y:1", inflight=0), draft_rec("z:1", methods=("draft_model",)),
                 draft_rec("d:1", draining=True)])
    first = pool._pick("s1", "ngram")
    assert first.address == "y:1"
    second = pool._pick("s2", "ngram")  # y:1 now has 1 in flight, x:1 reports 3
    assert second.address == "y:1"
    assert pool._pick("s3", "draft_model").address == "z:1"
    for m in (first, second):
        pool.members.done(m)
    with pytest.raises(Unavailable):
        GrpcDraftPool()._pick("s", "ngram")


class _Done:  # a Release future that has ended well
    def add_done_callback(self, fn):
        fn(self)

    def cancelled(self):
        return False

    def code(self):
        return grpc.StatusCode.OK


def test_draft_pool_spreads_rounds_and_releases_only_where_served():
    pool = GrpcDraftPool(("a:1", "b:1"))
    held = [pool._pick(f"s{i}", "ngram") for i in range(4)]
    assert Counter(m.address for m in held) == {"a:1": 2, "b:1": 2}
    sent = []
    for m in pool.members.snapshot():
        m.client.stub = type("S", (), {"Release": type("R", (), {"future": staticmethod(
            lambda req, timeout, a=m.address: sent.append((a, req.seq_id)) or _Done())})})()
    pool.release("s0")
    assert sent == [(held[0].address, "s0")]
    pool.release("never")
    assert len(sent) == 1


# ---------------------------------------------------------------------------- loop failover

SCRIPT = [(i % 20) + 1 for i in range(100)]


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + i) for i in ids)


class ScriptTarget:
    """Greedy 'model' over SCRIPT: the next token after a context of prompt + n outputs is SCRIPT[n]."""

    def __init__(self, address, die_after=None, error=Unavailable):
        self.address, self.die_after, self.error = address, die_after, error
        self.pos, self.calls, self.released, self.prefills = {}, 0, [], []

    def prefill(self, seq_id, prompt, params, timeout, max_new_tokens=0):
        self._maybe_die()
        self.prefills.append(len(prompt))
        self.pos[seq_id] = len(prompt) - 3 + 1  # 3 = prompt length
        return SCRIPT[len(prompt) - 3]

    def verify(self, seq_id, draft, timeout):
        self._maybe_die()
        p = self.pos[seq_id]
        self.pos[seq_id] = p + 1
        return VerifyOutcome(0, [SCRIPT[p]], False)

    def release(self, seq_id):
        self.released.append(seq_id)

    def _maybe_die(self):
        self.calls += 1
        if self.die_after is not None and self.calls > self.die_after:
            raise self.error("target went away")


def gen(target, reroute, max_reroutes=2, max_tokens=12):
    req = GenerationRequest(prompt_ids=[1, 2, 3], max_tokens=max_tokens, params=SamplingParams(), method="off", k=0,
                            stop=(), request_id="r", deadline=time.monotonic() + 30)
    return Generation(req, target, None, Tok(), {99}, 1.0, reroute=reroute, max_reroutes=max_reroutes,
                      target_timeout_s=5.0)


@pytest.mark.parametrize("error", [Unavailable, NotFound])
def test_target_death_mid_sequence_reprefills_elsewhere_same_output(error):
    dying, spare = ScriptTarget("a", die_after=4, error=error), ScriptTarget("b")
    tried = []
    g = gen(dying, lambda t: (tried.append(t), spare)[1])
    list(g.run())
    assert g.out.token_ids == SCRIPT[:12]
    assert tried == [("a",)] and g.reroutes == 1
    assert spare.prefills == [3 + 4]  # prompt + the 4 tokens emitted before the death
    assert dying.released and spare.released


def test_prefill_failure_goes_to_another_target():
    g = gen(ScriptTarget("a", die_after=0), lambda t: ScriptTarget("b"))
    list(g.run())
    assert g.out.token_ids == SCRIPT[:12]


def test_no_other_target_fails_unavailable_never_hangs():
    def none_left(tried):
        raise Unavailable("no target worker available")

    g = gen(ScriptTarget("a", die_after=3, error=NotFound), none_left)
    with pytest.raises(Unavailable, match="no target worker available"):
        list(g.run())
    g = gen(ScriptTarget("a", die_after=3), lambda t: ScriptTarget(f"n{len(t)}", die_after=0), max_reroutes=2)
    with pytest.raises(Unavailable, match="failed 2 time"):
        list(g.run())


class _Rpc(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "Cancelling all calls"


@pytest.mark.parametrize("code, expected", [(grpc.StatusCode.CANCELLED, Unavailable),
                                            (grpc.StatusCode.UNAVAILABLE, Unavailable),
                                            (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument)])
def test_target_client_reads_a_worker_side_cancel_as_unavailable(code, expected):
    """A stopping target worker cancels its in-flight calls; the loop fails over only on
    UNAVAILABLE, so CANCELLED (never sent by this client, whose calls block) must map to it."""
    client = GrpcTargetClient("127.0.0.1:1")

    class Stub:
        def Verify(self, *_a, **_k):
            raise _Rpc(code)

    client.stub = Stub()
    try:
        with pytest.raises(expected, match="target worker 127.0.0.1:1"):
            client.verify("s", DraftProposal(token_ids=[1, 2]), timeout=1.0)
    finally:
        client.close()
