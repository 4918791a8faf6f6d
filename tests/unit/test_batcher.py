"""specmesh.engine.batcher.Batcher: grouping, kinds, errors, back-pressure, result order."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specmesh.engine.batcher import Batcher
from specmesh.errors import Unavailable

WAIT = 10.0  # generous: the machine is shared and slow


class Recorder:
    """run_batch that records (kind, payloads) and can be held closed by a gate."""

    def __init__(self, fn=None, gate: threading.Event | None = None):
        self.batches: list[tuple[str, list]] = []
        self.fn = fn or (lambda kind, x: (kind, x))
        self.gate = gate
        self.started = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, kind, payloads):
        with self.lock:
            self.batches.append((kind, list(payloads)))
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT), "test gate never opened"
        return [self.fn(kind, p) for p in payloads]


@pytest.fixture
def make_batcher():
    made = []

    def make(run_batch, **kw):
        b = Batcher(run_batch, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def hold_first_batch(make_batcher, max_batch=8, max_queue=1024, fn=None):
    """A batcher whose model thread is stuck in its first batch (kind 'block') until gate is set."""
    gate = threading.Event()
    rec = Recorder(fn=fn, gate=gate)
    b = make_batcher(rec, max_batch=max_batch, max_queue=max_queue)
    first = b.submit("block", "first")
    assert rec.started.wait(WAIT)
    return b, rec, gate, first


def test_single_job_result(make_batcher):
    b = make_batcher(Recorder(fn=lambda k, x: x * 2), max_batch=4)
    assert b.submit("k", 21).result(WAIT) == 42


def test_concurrent_jobs_are_grouped_into_one_batch(make_batcher):
    b, rec, gate, first = hold_first_batch(make_batcher, max_batch=8, fn=lambda k, x: x)
    futures = [b.submit("verify", i) for i in range(5)]  # queue up while the model thread is busy
    gate.set()
    assert [f.result(WAIT) for f in futures] == list(range(5))
    assert first.result(WAIT) == "first"
    assert [len(p) for _, p in rec.batches] == [1, 5]
    assert rec.batches[1] == ("verify", [0, 1, 2, 3, 4])
    assert b.batches_run == 2 and b.jobs_run == 6


def test_concurrent_threads_get_batched(make_batcher):
    # real RPC-like load: many threads submit and block; some batch must hold more than one job
    def slow(kind, payloads):
        time.sleep(0.05)
        return [p + 1 for p in payloads]

    seen = []
    b = make_batcher(lambda k, ps: (seen.append(len(ps)), slow(k, ps))[1], max_batch=16)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: b.submit("prefill", i).result(WAIT), range(48)))
    assert results == [i + 1 for i in range(48)]
    assert max(seen) > 1
    assert sum(seen) == 48


def test_max_batch_is_respected(make_batcher):
    b, rec, gate, _ = hold_first_batch(make_batcher, max_batch=3, fn=lambda k, x: x)
    futures = [b.submit("v", i) for i in range(7)]
    gate.set()
    assert [f.result(WAIT) for f in futures] == list(range(7))
    sizes = [len(p) for _, p in rec.batches[1:]]
    assert sizes == [3, 3, 1]
    assert [p for _, p in rec.batches[1:]] == [[0, 1, 2], [3, 4, 5], [6]]


def test_kinds_never_mix_in_a_batch(make_batcher):
    b, rec, gate, _ = hold_first_batch(make_batcher, max_batch=8, fn=lambda k, x: (k, x))
    jobs = [("prefill" if i % 3 == 0 else "verify", i) for i in range(12)]
    futures = [(k, i, b.submit(k, i)) for k, i in jobs]
    gate.set()
    for k, i, f in futures:
        assert f.result(WAIT) == (k, i)  # each job answered by a batch of its own kind
    for kind, payloads in rec.batches[1:]:
        assert all(kind == ("prefill" if i % 3 == 0 else "verify") for i in payloads), (kind, payloads)
    # every job ran exactly once
    ran = sorted(i for _, ps in rec.batches[1:] for i in ps)
    assert ran == list(range(12))
    # the held-back kind is batched together too, not one by one
    assert len(rec.batches) - 1 == 2


def test_jobs_of_other_kind_keep_their_order(make_batcher):
    b, rec, gate, _ = hold_first_batch(make_batcher, max_batch=2, fn=lambda k, x: x)
    order = ["a", "b", "a", "b", "a", "b", "b"]
    futures = [b.submit(k, (k, i)) for i, k in enumerate(order)]
    gate.set()
    for f in futures:
        f.result(WAIT)
    for kind in "ab":
        ran = [p for k, ps in rec.batches[1:] if k == kind for p in ps]
        assert ran == [(k, i) for i, k in enumerate(order) if k == kind]


def test_exception_goes_to_every_job_of_the_batch(make_batcher):
    class Boom(RuntimeError):
        pass

    gate = threading.Event()
    calls = []

    def run(kind, payloads):
        calls.append((kind, list(payloads)))
        if kind == "block":
            gate.wait(WAIT)
            return payloads
        if kind == "bad":
            raise Boom("model exploded")
        return [p * 10 for p in payloads]

    b = make_batcher(run, max_batch=8)
    first = b.submit("block", 0)
    while not calls:
        time.sleep(0.01)
    bad = [b.submit("bad", i) for i in range(4)]
    good = [b.submit("good", i) for i in range(3)]
    gate.set()
    for f in bad:
        with pytest.raises(Boom, match="model exploded"):
            f.result(WAIT)
    assert [f.result(WAIT) for f in good] == [0, 10, 20]  # the batcher survives a failed batch
    assert first.result(WAIT) == 0
    assert [len(p) for k, p in calls if k == "bad"] == [4]
    assert b.submit("good", 5).result(WAIT) == 50


def test_per_job_exception_in_results(make_batcher):
    # run_batch may answer one job with an exception without failing its batch-mates
    b, rec, gate, _ = hold_first_batch(make_batcher, max_batch=8,
                                       fn=lambda k, p: ValueError(f"bad {p}") if p % 2 else p)
    futures = [b.submit("v", i) for i in range(4)]
    gate.set()
    assert futures[0].result(WAIT) == 0
    assert futures[2].result(WAIT) == 2
    with pytest.raises(ValueError, match="bad 1"):
        futures[1].result(WAIT)
    with pytest.raises(ValueError, match="bad 3"):
        futures[3].result(WAIT)
    assert [len(p) for _, p in rec.batches[1:]] == [4]


def test_queue_full_raises_unavailable(make_batcher):
    b, rec, gate, first = hold_first_batch(make_batcher, max_batch=1, max_queue=3, fn=lambda k, x: x)
    accepted = [b.submit("v", i) for i in range(3)]
    with pytest.raises(Unavailable, match="queue is full"):
        b.submit("v", 99)
    assert b.qsize() == 3
    gate.set()
    assert [f.result(WAIT) for f in accepted] == [0, 1, 2]
    assert b.submit("v", 4).result(WAIT) == 4  # space again once drained


def test_unavailable_maps_to_grpc_unavailable():
    from specmesh.rpc.errors import status_code
    import grpc

    assert status_code(Unavailable("x")) == grpc.StatusCode.UNAVAILABLE


def test_results_in_submission_order(make_batcher):
    b, rec, gate, _ = hold_first_batch(make_batcher, max_batch=16, fn=lambda k, x: f"r{x}")
    futures = [b.submit("v", i) for i in range(10)]
    gate.set()
    assert [f.result(WAIT) for f in futures] == [f"r{i}" for i in range(10)]
    assert rec.batches[1][1] == list(range(10))  # payloads handed over in submission order


def test_results_matched_to_jobs_when_run_batch_reverses_work(make_batcher):
    # run_batch must return results in payload order; each caller gets its own result
    def run(kind, payloads):
        out = {p: p ** 2 for p in reversed(payloads)}  # computed in another order
        return [out[p] for p in payloads]

    b = make_batcher(run, max_batch=8)
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda i: b.submit("v", i).result(WAIT), range(20)))
    assert got == [i * i for i in range(20)]


def test_cancelled_job_is_skipped(make_batcher):
    b, rec, gate, _ = hold_first_batch(make_batcher, max_batch=8, fn=lambda k, x: x)
    f1 = b.submit("v", 1)
    f2 = b.submit("v", 2)
    assert f1.cancel()
    gate.set()
    assert f2.result(WAIT) == 2
    assert [p for _, p in rec.batches[1:]] == [[2]]


def test_close_stops_the_thread(make_batcher):
    b = make_batcher(Recorder(), max_batch=2)
    b.close()
    assert not b._thread.is_alive()


def test_gather_waits_for_jobs_it_is_told_are_coming_and_no_longer(make_batcher):
    """Three jobs said to be coming, arriving 50 ms apart: one batch of three (gathered), while a
    job nobody is coming after runs at once, and a promise that is not kept costs at most the wait."""
    rec = Recorder()
    expected = {"n": 3}
    b = make_batcher(rec, max_batch=8, gather=lambda kind, n: (expected["n"], 2.0 if kind == "verify" else 0.0))
    futures = []
    for i in range(3):
        futures.append(b.submit("verify", i))
        time.sleep(0.05)
    assert [f.result(WAIT) for f in futures] == [("verify", i) for i in range(3)]
    assert rec.batches == [("verify", [0, 1, 2])]
    assert b.submit("prefill", "p").result(WAIT) == ("prefill", "p")  # no wait for another kind
    expected["n"] = 5  # two more promised, never sent: the batch goes after the wait
    t0 = time.monotonic()
    assert b.submit("verify", 9).result(WAIT) == ("verify", 9)
    assert 1.5 < time.monotonic() - t0 < WAIT


def test_target_engine_gathers_the_sequences_between_rounds(target_model):
    """Four sequences in lockstep, their rounds sent 10 ms apart: with batch_gather (waiting up to
    2x a ~50 ms forward) every round of the four is one forward; without it the first goes alone."""
    from target_worker.engine import TargetEngine
    from specmesh.core.types import DraftProposal, SamplingParams

    def rounds(gather: float) -> list[int]:
        engine = TargetEngine(target_model, 8, 8, 4096, 60.0, batch_gather=gather)
        try:
            engine._last_verify_s = 0.5  # before any forward: long enough for the first round
            params = SamplingParams(temperature=0.0)
            for i in range(4):
                engine.prefill(f"s{i}", [10 + i, 11, 12], params)
            engine.last_batch_sizes.clear()
            for _ in range(2):
                with ThreadPoolExecutor(4) as pool:
                    done = []
                    for i in range(4):
                        done.append(pool.submit(engine.verify, f"s{i}", DraftProposal([], None)))
                        time.sleep(0.01)
                    [f.result(WAIT) for f in done]
            return list(engine.last_batch_sizes)
        finally:
            engine.close()

    assert rounds(2.0) == [4, 4]
    assert rounds(0.0)[0] == 1


def test_gather_counts_a_slow_models_sequences_between_rounds(target_model):
    """A 1.5B target on a CPU takes ~0.7-1.5 s a forward: a sequence back from its last round was
    touched more than a second ago and still comes (the pair at concurrency 4 ran mean batch 1.2
    when it was not counted)."""
    from target_worker.engine import TargetEngine
    from specmesh.core.types import SamplingParams

    engine = TargetEngine(target_model, 8, 8, 4096, 60.0, batch_gather=0.3)
    try:
        for i in range(3):
            engine.prefill(f"s{i}", [10 + i, 11, 12], SamplingParams(temperature=0.0))
        engine._last_verify_s = 1.2  # a slow model's last forward
        for seq in engine._seqs.values():
            seq.last_used = time.monotonic() - 2.0  # claimed for its last round two seconds ago
        assert engine._gather("verify", 1) == (1 + 3, 0.3 * 1.2)
        for seq in engine._seqs.values():
            seq.last_used = time.monotonic() - 10.0  # idle: not coming
        assert engine._gather("verify", 1)[0] == 1
    finally:
        engine.close()


def test_a_streaming_batch_answers_early_takes_joiners_and_yields_to_another_kind(make_batcher):
    """streaming=True: run_batch gets the Stream; a job answered with deliver() gets its result at
    once (the batch still runs), queued jobs of the batch's kind join it, a job of another kind is
    held for the next batch and reported by others_waiting()."""
    proceed, seen = threading.Event(), {}

    def run(kind, payloads, stream):
        if kind != "step":
            return [f"{kind}:{p}" for p in payloads]
        stream.deliver(0, "early")  # the first job is done after its first step
        assert proceed.wait(WAIT)  # meanwhile: another "step" job and a "prefill" job queue up
        assert stream.take_more(running=8) == []  # max_batch 8: no room beside 8 running jobs
        joined = stream.take_more(running=4)
        seen.update(joined=joined, others=stream.others_waiting())
        payloads = payloads + joined
        return [f"late:{p}" for p in payloads]

    b = make_batcher(run, max_batch=8, streaming=True)
    first, second = b.submit("step", "a"), b.submit("step", "b")
    assert first.result(WAIT) == "early" and not second.done()
    joiner, other = b.submit("step", "c"), b.submit("prefill", "p")
    proceed.set()
    assert second.result(WAIT) == "late:b" and joiner.result(WAIT) == "late:c"
    assert other.result(WAIT) == "prefill:p"  # ran as its own batch after
    # "b" was in the first batch, or (the model thread took "a" before "b" was queued) joined with "c"
    assert seen["joined"] in (["c"], ["b", "c"]) and seen["others"]


def test_a_streaming_batchs_next_step_gathers_the_jobs_it_just_answered(make_batcher):
    """A streaming batch takes the jobs queued during a step into its next step; with a gather it
    also waits (bounded) for those said to be coming, as a new batch does. Without that, a job
    queued during a step started the next step alone while the jobs just answered came back a few
    ms later, and four sequences settled into two groups taking turns (half the batch a forward:
    the pair at concurrency 4, docs/pair.md)."""
    steps, gate = [], threading.Event()

    def run(kind, payloads, stream):
        payloads, running = list(payloads), list(range(len(payloads)))
        while running:
            steps.append([payloads[i] for i in running])
            assert gate.wait(WAIT)
            for i in running:
                stream.deliver(i, payloads[i])
            joined = stream.take_more(0)
            payloads += joined
            running = list(range(len(payloads) - len(joined), len(payloads)))
        return payloads

    coming = {"n": 1}
    b = make_batcher(run, max_batch=8, streaming=True, gather=lambda kind, n: (coming["n"], 2.0))
    a = b.submit("verify", "a")
    deadline = time.monotonic() + WAIT
    while not steps and time.monotonic() < deadline:
        time.sleep(0.005)
    queued = b.submit("verify", "b")  # queued during "a"'s step
    coming["n"] = 2  # and "a" is said to come back for its next round
    gate.set()
    assert a.result(WAIT) == "a"
    time.sleep(0.05)
    again = b.submit("verify", "a2")  # back 50 ms later: it joins "b" in the next step
    assert queued.result(WAIT) == "b" and again.result(WAIT) == "a2"
    assert steps == [["a"], ["b", "a2"]]
    coming["n"] = 1
    assert b.submit("verify", "c").result(WAIT) == "c"  # nothing else said to come: no wait


def test_a_streaming_batch_runs_a_waiting_prefill_between_its_steps_and_goes_on(make_batcher):
    """run_others: a job of another kind queued during a step (a new request's prefill) runs as its
    own batch between two steps; the running jobs keep their places and finish their steps (they
    used to be answered early and asked again). Same-kind jobs held over max_batch join first."""
    order, gate = [], threading.Event()

    def run(kind, payloads, stream):
        if kind != "verify":
            order.append((kind, list(payloads)))
            return [f"{kind}:{p}" for p in payloads]
        for step in range(3):
            order.append(("step", step))
            if step == 0:
                assert gate.wait(WAIT)  # meanwhile a prefill queues up
                assert stream.take_more(running=len(payloads)) == [] and stream.others_waiting()
            stream.run_others()
        assert not stream.others_waiting()
        return [f"done:{p}" for p in payloads]

    b = make_batcher(run, max_batch=8, streaming=True)
    burst = b.submit("verify", "a")
    deadline = time.monotonic() + WAIT
    while not order and time.monotonic() < deadline:
        time.sleep(0.005)
    prefill = b.submit("prefill", "p")
    time.sleep(0.05)
    gate.set()
    assert prefill.result(WAIT) == "prefill:p" and burst.result(WAIT) == "done:a"
    assert order == [("step", 0), ("prefill", ["p"]), ("step", 1), ("step", 2)]


def test_take_more_takes_same_kind_jobs_held_over_max_batch_before_newer_ones(make_batcher):
    gate, joined = threading.Event(), {}

    def run(kind, payloads, stream):
        assert gate.wait(WAIT)
        if kind == "verify" and payloads == ["a"]:
            stream.deliver(0, "a")
            joined["first"] = stream.take_more(running=0)
            return ["a"] + [f"late:{p}" for p in joined["first"]]
        return list(payloads)

    b = make_batcher(run, max_batch=1, streaming=True)
    a = b.submit("verify", "a")
    deadline = time.monotonic() + WAIT
    while b.qsize() and time.monotonic() < deadline:
        time.sleep(0.005)
    later = [b.submit("verify", x) for x in "bc"]
    b._held.append(b._queue.get_nowait())  # "b" held back as a full batch's overflow would be
    gate.set()
    assert a.result(WAIT) == "a" and later[0].result(WAIT) == "late:b" and later[1].result(WAIT) == "c"
    assert joined["first"] == ["b"]
