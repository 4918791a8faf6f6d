"""DraftWorker over gRPC (real server on a free port). The draft_model drafter is the default
model drafting for itself (no draft model configured), so at T=0 it must propose exactly the
target's greedy continuation."""

from __future__ import annotations

import grpc
import pytest
import torch

import draft_worker.model_drafter as drafters_module
from specmesh.rpc.convert import proposal_from_pb
from specmesh.v1 import specmesh_pb2 as pb

pytestmark = pytest.mark.service

PROMPT = "Write a haiku about autumn leaves falling in the wind."


@pytest.fixture
def worker(services):
    return services(components=("draft_worker",))


@pytest.fixture(scope="module")
def context(prompt_encoder):
    return prompt_encoder.encode(PROMPT, None)


def _propose(stub, context, k, method="draft_model", seq_id="s", temperature=None, seed=None, round_=0, budget_s=0.0):
    sampling = pb.SamplingOptions()
    if temperature is not None:
        sampling.temperature = temperature
    if seed is not None:
        sampling.seed = seed
    req = pb.ProposeRequest(seq_id=seq_id, context=list(context), num_tokens=k, method=method, sampling=sampling,
                            round=round_, budget_s=budget_s)
    return stub.Propose(req, timeout=120)


def test_ngram_proposes_what_followed_the_suffix(worker):
    stub = worker.draft_stub
    ctx = [7, 8, 9, 10, 11, 12, 7, 8, 9]
    resp = _propose(stub, ctx, 3, method="ngram")
    assert list(resp.token_ids) == [10, 11, 12]
    assert resp.probs == b"" and resp.vocab_size == 0  # point mass
    assert list(_propose(stub, ctx, 5, method="ngram").token_ids) == [10, 11, 12, 7, 8]
    assert list(_propose(stub, [1, 2, 3, 4], 3, method="ngram").token_ids) == []  # nothing repeats


def test_greedy_self_draft_is_the_target_greedy_continuation(worker, context, hf_reference):
    k = 6
    resp = _propose(worker.draft_stub, context, k, temperature=0.0)
    ref = hf_reference(prompt_ids=context, max_tokens=k)
    assert len(ref.token_ids) == k and 2 not in ref.token_ids
    assert list(resp.token_ids) == ref.token_ids
    assert resp.probs == b"" and resp.vocab_size == 0, "greedy drafts are a point mass: no probs"


def test_sampled_drafts_carry_their_distributions(worker, context):
    k = 3
    resp = _propose(worker.draft_stub, context, k, temperature=0.7, seed=11)
    vocab = worker.drafters["draft_model"].vocab_size
    assert resp.vocab_size == vocab and len(resp.token_ids) == k
    # truncated to draft_model.proposal_top_k (64) tokens: sparse on the wire, 8 bytes per entry
    assert resp.probs == b"" and list(resp.sparse_probs.row_lengths) == [64] * k
    assert resp.ByteSize() < k * 64 * 8 + 256 < k * vocab * 4 // 100
    probs = proposal_from_pb(resp.token_ids, resp.probs, resp.vocab_size, sparse=resp.sparse_probs).probs
    assert probs.shape == (k, vocab) and probs.dtype == torch.float32
    assert [int((row > 0).sum()) for row in probs] == [64] * k
    assert torch.allclose(probs.sum(dim=-1), torch.ones(k), atol=1e-4)
    assert bool((probs >= 0).all())
    for i, t in enumerate(resp.token_ids):
        assert probs[i, t] > 0, "a drafted token must have positive probability under its own row"
    again = _propose(worker.draft_stub, context, k, temperature=0.7, seed=11, seq_id="other")
    assert again.vocab_size == vocab


def test_a_budgeted_proposal_answers_in_time_with_what_it_drafted(worker, context, hf_reference):
    """budget_s (a pre-draft beside live others): up to k tokens, those drafted in the budget, at
    least one; they are the model's own greedy continuation as far as they go."""
    import time

    stub = worker.draft_stub
    _propose(stub, context, 1, seq_id="warm")  # the worker's first forward is slow
    t0 = time.monotonic()
    resp = _propose(stub, context, 16, seq_id="budget", budget_s=0.001)
    assert len(resp.token_ids) == 1 and time.monotonic() - t0 < 60
    full = _propose(stub, context, 16, seq_id="full")
    assert list(full.token_ids) == hf_reference(prompt_ids=context, max_tokens=16).token_ids
    assert list(resp.token_ids) == list(full.token_ids[:1])


def test_bad_requests_are_invalid_argument(worker, context):
    stub = worker.draft_stub
    for kwargs in (dict(method="medusa"), dict(method=""), dict(k=17), dict(k=-1), dict(budget_s=-1.0),
                   dict(budget_s=float("nan")), dict(budget_s=1e9)):
        k = kwargs.pop("k", 2)
        with pytest.raises(grpc.RpcError) as info:
            _propose(stub, context, k, **kwargs)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kwargs
    with pytest.raises(grpc.RpcError) as info:
        _propose(stub, [], 2)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_cache_reuse_forwards_only_the_new_suffix(worker, context, monkeypatch):
    forwards: list[list[int]] = []  # per batched_step: the new-token count of each sequence
    real_step = drafters_module.batched_step

    def counting_step(model, kvs, inputs, *args, **kwargs):
        forwards.append([len(x) for x in inputs])
        return real_step(model, kvs, inputs, *args, **kwargs)

    monkeypatch.setattr(drafters_module, "batched_step", counting_step)
    drafter = worker.drafters["draft_model"]
    stub, k, n = worker.draft_stub, 4, len(context)

    first = list(_propose(stub, context, k, temperature=0.0).token_ids)
    assert forwards == [[n], [1], [1], [1]]  # the context, then k-1 one-token steps
    cached = drafter._cache["s"]
    assert cached.kv.length == len(cached.tokens) == n + k - 1  # the last draft is never forwarded
    assert cached.tokens == context + first[:-1]

    # the target accepted two drafts and emitted its own third token: only that token is new
    other = (first[2] + 1) % drafter.vocab_size
    extended = context + first[:2] + [other]
    forwards.clear()
    second = list(_propose(stub, extended, k, temperature=0.0, round_=1).token_ids)
    assert forwards == [[1], [1], [1], [1]]
    cached = drafter._cache["s"]
    assert cached.kv.length == len(cached.tokens) == len(extended) + k - 1
    assert cached.tokens == extended + second[:-1]

    # another sequence does not disturb it; Release drops the cache entry
    _propose(stub, context[:5], 2, temperature=0.0, seq_id="t")
    assert drafter.cached_sequences() == 2
    stub.Release(pb.ReleaseDraftRequest(seq_id="s"), timeout=10)
    assert "s" not in drafter._cache and drafter.cached_sequences() == 1
    forwards.clear()
    _propose(stub, extended, 1, temperature=0.0)  # a miss just recomputes the whole context
    assert forwards == [[len(extended)]]


def test_a_cancelled_propose_stops_drafting_and_frees_the_worker(worker, context, monkeypatch):
    """The coordinator cancels a pre-draft it found stale: the worker stops after the step in
    progress (instead of drafting all k), keeps the cache it built, and serves the next call."""
    import threading

    started, release = threading.Event(), threading.Event()
    real_step = drafters_module.batched_step
    steps = []

    def slow_step(model, kvs, inputs, *args, **kwargs):
        steps.append(len(inputs[0]))
        started.set()
        release.wait(10)  # the first call is cancelled while this step runs
        return real_step(model, kvs, inputs, *args, **kwargs)

    monkeypatch.setattr(drafters_module, "batched_step", slow_step)
    sampling = pb.SamplingOptions(temperature=0.0)
    req = pb.ProposeRequest(seq_id="c", context=list(context), num_tokens=8, method="draft_model", sampling=sampling)
    call = worker.draft_stub.Propose.future(req, timeout=120)
    assert started.wait(30)
    call.cancel()
    release.set()
    with pytest.raises(grpc.FutureCancelledError):
        call.result()
    # the next call runs after the cancelled one on the worker's model thread: the worker is free
    after = _propose(worker.draft_stub, context, 2, seq_id="c", temperature=0.0)
    assert len(after.token_ids) == 2
    # drafting all 8 would take 8 steps, then 2 more for the next call; cancelled, at most one more
    # step ran after the one in progress, and the next call needed its 2
    assert steps[0] == len(context) and len(steps) <= 4, steps
