"""TargetWorker over gRPC (real server on a free port, real TargetEngine on the default model).

A sequence's cache holds every token but the last emitted one ("pending"): after Prefill of an
L-token prompt it holds L; a Verify that accepts n drafts adds n + 1 ([pending, d_1..d_n]).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specmesh.v1 import specmesh_pb2 as pb

pytestmark = pytest.mark.service

TARGET_ONLY = ("target_worker",)
PROMPT = "Count from one to ten in words, separated by commas."
GREEDY = pb.SamplingOptions(temperature=0.0)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def _prefill(stub, seq_id, prompt) -> int:
    return stub.Prefill(pb.PrefillRequest(seq_id=seq_id, prompt=prompt, sampling=GREEDY), timeout=120).token_id


def _verify(stub, seq_id, draft=()):
    return stub.Verify(pb.VerifyRequest(seq_id=seq_id, draft_token_ids=list(draft)), timeout=120)


def _status(stub):
    return stub.Status(pb.WorkerStatusRequest(), timeout=10)


@pytest.fixture
def worker(services):
    return services(components=TARGET_ONLY)


@pytest.fixture(scope="module")
def prompt_ids(prompt_encoder):
    return prompt_encoder.encode(PROMPT, None)


def _greedy_ar(stub, seq_id, prompt, steps: int) -> list[int]:
    """Plain AR through the worker: Prefill, then Verify with empty drafts."""
    tokens = [_prefill(stub, seq_id, prompt)]
    for _ in range(steps):
        out = _verify(stub, seq_id)
        assert (out.accepted, out.bonus, len(out.token_ids)) == (0, True, 1)
        tokens += list(out.token_ids)
    stub.Release(pb.ReleaseRequest(seq_id=seq_id), timeout=10)
    return tokens


def test_verify_accepts_a_correct_draft_and_recovers_a_wrong_one(worker, prompt_ids, target_model):
    stub = worker.target_stub
    ar = _greedy_ar(stub, "ar", prompt_ids, steps=5)  # t_0 .. t_5
    k = 4
    # correct draft t_1..t_4 -> all accepted, bonus t_5
    assert _prefill(stub, "good", prompt_ids) == ar[0]
    out = _verify(stub, "good", ar[1:1 + k])
    assert out.accepted == k and out.bonus
    assert list(out.token_ids) == ar[1:k + 2]
    # wrong second token -> d_1 accepted, then the target's own t_2 (recovered, not a bonus)
    wrong = (ar[2] + 1) % target_model.config.vocab_size
    assert _prefill(stub, "bad", prompt_ids) == ar[0]
    out = _verify(stub, "bad", [ar[1], wrong, ar[3], ar[4]])
    assert (out.accepted, out.bonus) == (1, False)
    assert list(out.token_ids) == [ar[1], ar[2]]
    # the rejected tail left nothing behind: the next round continues the greedy sequence
    out = _verify(stub, "bad", [ar[3], ar[4]])
    assert (out.accepted, list(out.token_ids)) == (2, ar[3:6])


def test_a_burst_with_prompt_lookup_over_grpc(worker, prompt_ids):
    """decode_steps with ngram_burst: the target drafts each later step by prompt lookup; the
    reply lists every step's drafted / accepted, the tokens are greedy AR's, max_tokens holds, and
    bad lookup sizes are INVALID_ARGUMENT."""
    stub = worker.target_stub
    prompt = prompt_ids * 3  # repeated: the lookups find the continuation
    ar = _greedy_ar(stub, "ar", prompt, steps=12)
    assert _prefill(stub, "b", prompt) == ar[0]
    got, drafted = [], 0
    while len(got) < 12:
        out = stub.Verify(pb.VerifyRequest(seq_id="b", decode_steps=6, ngram_burst=pb.NgramBurst(
            k=4, min_n=1, max_n=4, max_tokens=12 - len(got))), timeout=120)
        steps = list(zip(out.step_drafted, out.step_accepted))
        assert 1 <= len(steps) <= 6 and sum(a + 1 for _, a in steps) == len(out.token_ids)
        got, drafted = got + list(out.token_ids), drafted + sum(d for d, _ in steps)
    assert got == ar[1:13] and drafted > 0
    bad = pb.VerifyRequest(seq_id="b", decode_steps=2, ngram_burst=pb.NgramBurst(k=4, min_n=0, max_n=4, max_tokens=4))
    assert _code(lambda: stub.Verify(bad, timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT


def test_status_tracks_sequences_and_kv_bytes(worker, prompt_ids, target_model):
    stub, engine = worker.target_stub, worker.engine
    cfg = target_model.config
    elem = next(target_model.parameters()).element_size()  # bytes per KV element (model dtype)
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem  # K and V
    st = _status(stub)
    assert (st.live_sequences, st.kv_cache_bytes, st.vocab_size) == (0, 0, cfg.vocab_size)
    assert st.model == "test-target"

    first = _prefill(stub, "s1", prompt_ids)
    st = _status(stub)
    assert (st.live_sequences, st.kv_cache_bytes) == (1, per_token * len(prompt_ids))
    _prefill(stub, "s2", prompt_ids[:10])
    st = _status(stub)
    assert (st.live_sequences, st.kv_cache_bytes) == (2, per_token * (len(prompt_ids) + 10))

    out = _verify(stub, "s1", [first, first])  # whatever is accepted, the cache grows by accepted + 1
    st = _status(stub)
    assert st.kv_cache_bytes == per_token * (len(prompt_ids) + out.accepted + 1 + 10)
    assert engine.live_sequences() == 2 and engine.kv_bytes() == st.kv_cache_bytes
    # the verify cost model: the 3-row round just run is in it, in Status and in the Verify reply
    assert 3 in st.verify_cost.rows and all(s > 0 for s in st.verify_cost.seconds)
    assert list(out.verify_cost.rows) and st.verify_cost.mean_batch >= 1
    reserved = engine.reserved_tokens()  # each live sequence owns its range: held + headroom
    assert reserved >= len(prompt_ids) + 10 + out.accepted + 1 and engine.pool.free_tokens() + reserved == engine.pool.max_tokens

    assert stub.Release(pb.ReleaseRequest(seq_id="s1"), timeout=10).released
    assert _status(stub).kv_cache_bytes == per_token * 10
    assert stub.Release(pb.ReleaseRequest(seq_id="s2"), timeout=10).released
    assert not stub.Release(pb.ReleaseRequest(seq_id="s2"), timeout=10).released  # already gone
    st = _status(stub)
    assert (st.live_sequences, st.kv_cache_bytes, st.queue_length) == (0, 0, 0)
    assert engine.reserved_tokens() == 0  # every range back in the pool


def test_verify_reports_cache_length(worker, prompt_ids):
    stub = worker.target_stub
    first = _prefill(stub, "c", prompt_ids)
    out = _verify(stub, "c", [first])
    assert out.cache_length == len(prompt_ids) + out.accepted + 1


def test_error_codes(worker, prompt_ids):
    stub = worker.target_stub
    vocab = worker.engine.vocab_size
    assert _code(lambda: _verify(stub, "nobody", [1, 2])) == grpc.StatusCode.NOT_FOUND
    _prefill(stub, "dup", prompt_ids[:8])
    assert _code(lambda: _prefill(stub, "dup", prompt_ids[:8])) == grpc.StatusCode.FAILED_PRECONDITION
    assert worker.engine.live_sequences() == 1, "the refused Prefill must not drop the live sequence"
    assert _code(lambda: _prefill(stub, "bad-prompt", [5, vocab])) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: _prefill(stub, "empty", [])) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: _verify(stub, "dup", [vocab])) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: _verify(stub, "dup", [-1])) == grpc.StatusCode.INVALID_ARGUMENT
    assert worker.engine.live_sequences() == 1
    assert len(_verify(stub, "dup").token_ids) == 1, "a refused Verify leaves the sequence usable"


def test_kv_full_is_unavailable(services):
    w = services({"target_worker": {"cache": {"max_sequences": 2, "max_tokens": 40}}}, components=TARGET_ONLY)
    stub = w.target_stub
    short = list(range(100, 108))  # 8 tokens
    _prefill(stub, "a", short)
    _prefill(stub, "b", short)
    assert _code(lambda: _prefill(stub, "c", short)) == grpc.StatusCode.UNAVAILABLE  # sequence limit
    assert _status(stub).live_sequences == 2
    stub.Release(pb.ReleaseRequest(seq_id="b"), timeout=10)
    assert _code(lambda: _prefill(stub, "d", list(range(100, 135)))) == grpc.StatusCode.UNAVAILABLE  # 8+35 > 40
    _prefill(stub, "e", list(range(100, 130)))  # 8 + 30 <= 40
    assert _status(stub).live_sequences == 2


def test_idle_sequences_are_reclaimed(services, prompt_ids):
    w = services({"target_worker": {"cache": {"idle_timeout_s": 0.05}}}, components=TARGET_ONLY)
    stub = w.target_stub
    _prefill(stub, "idle", prompt_ids[:8])
    assert w.engine.reclaim_idle() == []  # not idle yet
    time.sleep(0.2)
    assert w.engine.reclaim_idle() == ["idle"]
    st = _status(stub)
    assert (st.live_sequences, st.kv_cache_bytes) == (0, 0)
    assert _code(lambda: _verify(stub, "idle")) == grpc.StatusCode.NOT_FOUND


# Raw text with an obvious continuation, of different lengths. Their first four greedy tokens
# all win by a top-2 logit gap >= 1.2, above the up-to-~0.8 logit noise of a padded bf16 batch
# (not batch-invariant, see test_identity), so batching must not change any outcome here.
BATCH_PROMPTS = [
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Sunday, Monday, Tuesday, Wednesday, Thursday,",
    "a, b, c, d, e, f, g,",
    "A B C D E F G H I J",
    "one, two, three, four, five, six,",
    "2, 4, 6, 8, 10, 12,",
    "100, 200, 300, 400,",
    "10, 20, 30, 40, 50, 60, 70,",
]


def test_concurrent_verifies_are_batched_with_serial_results(services, target_tokenizer):
    w = services(components=TARGET_ONLY)
    stub, engine = w.target_stub, w.engine
    prompts = [list(target_tokenizer(p)["input_ids"]) for p in BATCH_PROMPTS]
    assert len({len(p) for p in prompts}) > 2, "the batch should mix lengths (padding)"
    ar = [_greedy_ar(stub, f"ar{i}", p, steps=2) for i, p in enumerate(prompts)]  # t_0, t_1, t_2
    # drafts of different lengths: empty, correct, correct then wrong, wrong
    drafts = []
    for i, (t0, t1, t2) in enumerate(ar):
        drafts.append([[], [t1], [t1, t2], [t1, (t2 + 7) % engine.vocab_size, 11], [(t1 + 3) % engine.vocab_size]][i % 5])

    serial = []
    for i, p in enumerate(prompts):
        assert _prefill(stub, f"ser{i}", p) == ar[i][0]
        serial.append(_verify(stub, f"ser{i}", drafts[i]))
        stub.Release(pb.ReleaseRequest(seq_id=f"ser{i}"), timeout=10)
    for i, out in enumerate(serial):  # sanity: the drafts do what they were built to do
        assert out.accepted == [0, 1, 2, 1, 0][i % 5], (BATCH_PROMPTS[i], drafts[i], out)
        n = min(len(out.token_ids), 2)
        assert list(out.token_ids)[:n] == ar[i][1:1 + n]

    for i, p in enumerate(prompts):
        _prefill(stub, f"con{i}", p)
    before = len(engine.last_batch_sizes)
    barrier = threading.Barrier(len(prompts))

    def call(i):
        barrier.wait()
        return _verify(stub, f"con{i}", drafts[i])

    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = list(pool.map(call, range(len(prompts))))
    batches = engine.last_batch_sizes[before:]
    assert sum(batches) == len(prompts)
    assert len(batches) < len(prompts) and max(batches) > 1, f"verifies were not batched: {batches}"
    for i, (a, b) in enumerate(zip(serial, concurrent)):
        assert (b.accepted, list(b.token_ids), b.bonus) == (a.accepted, list(a.token_ids), a.bonus), \
            f"prompt {BATCH_PROMPTS[i]!r} draft {drafts[i]}: batched {b} != serial {a} (batches {batches})"
