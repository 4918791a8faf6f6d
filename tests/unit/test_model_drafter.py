"""ModelDrafter's model thread: per-step batching with joiners, on a tiny random Llama (float32).
A proposal that arrives while another drafts joins its next forward, each is answered when its
own k tokens are done, and every draft is the model's own greedy continuation either way."""

import threading

import pytest
import torch

import draft_worker.model_drafter as md
from draft_worker.drafters import ProposeJob
from specmesh.core.types import SamplingParams

V = 64


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def greedy(model, context: list[int], k: int) -> list[int]:
    """k greedy tokens after context, by plain full forwards (no cache)."""
    ids = list(context)
    with torch.inference_mode():
        for _ in range(k):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(context):]


def prompt(seed: int, n: int = 20) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(0, V, (n,), generator=g)]


@pytest.fixture
def recorded(monkeypatch):
    """Sequences per draft-model forward; a hook run before the first forward."""
    calls, hook = [], []
    real = md.batched_step

    def step(model, kvs, inputs, **kw):
        if not calls and hook:
            hook.pop()()
        calls.append(len(kvs))
        return real(model, kvs, inputs, **kw)

    monkeypatch.setattr(md, "batched_step", step)
    return calls, hook


def job(seq: str, context: list[int], k: int, **kw) -> ProposeJob:
    return ProposeJob(seq, context, k, SamplingParams(**kw), 0)


def test_a_proposal_that_arrives_mid_draft_joins_the_next_forward(model, recorded):
    calls, hook = recorded
    drafter = md.ModelDrafter(model, max_batch_size=8, cache_max_sequences=8)
    a_ctx, b_ctx = prompt(1), prompt(2, 30)
    later = {}
    # B is submitted from the model thread just before A's first forward: it waits in the queue
    hook.append(lambda: later.setdefault("b", drafter.batcher.submit("propose", job("b", b_ctx, 3))))
    try:
        a = drafter.propose(job("a", a_ctx, 6), timeout=60)
        b = later["b"].result(timeout=60)
    finally:
        drafter.close()
    assert a.token_ids == greedy(model, a_ctx, 6)
    assert b.token_ids == greedy(model, b_ctx, 3)
    # A's first forward ran alone; B joined the second and left after its third; A drafted alone
    # for its last three: 6 forwards for 9 tokens, where one batch after the other took 9
    assert calls == [1, 2, 2, 2, 1, 1]


def test_a_new_proposal_for_a_sequence_supersedes_the_one_in_flight(model, recorded):
    """The coordinator proposes again for a sequence only after dropping its stale pre-draft; if
    that cancel has not arrived, the stale one is answered as it stands and the new one continues
    from its cache (no redraft from scratch)."""
    calls, hook = recorded
    drafter = md.ModelDrafter(model, max_batch_size=8, cache_max_sequences=8)
    ctx = prompt(3)
    stale_tokens = greedy(model, ctx, 1)
    later = {}
    hook.append(lambda: later.setdefault("new", drafter.batcher.submit(
        "propose", job("s", ctx + stale_tokens, 2))))
    try:
        stale = drafter.propose(job("s", ctx, 8), timeout=60)
        new = later["new"].result(timeout=60)
    finally:
        drafter.close()
    assert stale.token_ids == stale_tokens  # one token drafted when the new proposal arrived
    assert new.token_ids == greedy(model, ctx + stale_tokens, 2)
    assert calls == [1, 1, 1]


def test_concurrent_seeded_samples_equal_each_drafted_alone(model):
    """T > 0: each proposal draws from its own (seed, round) stream, so drafting beside others
    gives the draws and the distributions it gives alone."""
    alone = md.ModelDrafter(model, max_batch_size=1, cache_max_sequences=8, proposal_top_k=8)
    together = md.ModelDrafter(model, max_batch_size=8, cache_max_sequences=8, proposal_top_k=8)
    jobs = [job(f"s{i}", prompt(10 + i, 12 + 5 * i), 2 + i, temperature=1.0, seed=i) for i in range(4)]
    try:
        solo = [alone.propose(j, timeout=60) for j in jobs]
        out, threads = [None] * 4, []
        for i, j in enumerate(jobs):
            threads.append(threading.Thread(target=lambda i=i, j=j: out.__setitem__(i, together.propose(j, 60))))
            threads[-1].start()
        for t in threads:
            t.join(60)
    finally:
        alone.close()
        together.close()
    for s, o in zip(solo, out):
        assert o.token_ids == s.token_ids
        assert o.probs.shape == (len(s.token_ids), V)
        assert torch.allclose(o.probs, s.probs, atol=1e-5)
        assert int((o.probs[0] > 0).sum()) == 8  # the sparse proposal: its top 8 only


def test_a_budgeted_proposal_stops_when_one_more_step_would_overrun(model, monkeypatch):
    """ProposeJob.stop_at (a pre-draft beside live others, sized to the target's forward): the
    drafter answers with what it drafted once another step would end past it, at least one token,
    the model's own continuation as far as it goes; a job without one drafts all k."""
    import time

    real = md.batched_step

    def slow(model, kvs, inputs, **kw):
        time.sleep(0.02)
        return real(model, kvs, inputs, **kw)

    monkeypatch.setattr(md, "batched_step", slow)
    drafter = md.ModelDrafter(model, max_batch_size=8, cache_max_sequences=8)
    ctx = prompt(5)
    try:
        t0 = time.monotonic()
        job_ = ProposeJob("a", ctx, 100, SamplingParams(), 0, stop_at=t0 + 0.3)  # all 100: 2+ s
        short = drafter.propose(job_, timeout=60)
        took = time.monotonic() - t0
        late = drafter.propose(ProposeJob("b", ctx, 100, SamplingParams(), 0, stop_at=time.monotonic() - 1), timeout=60)
        whole = drafter.propose(job("c", ctx, 12), timeout=60)
    finally:
        drafter.close()
    assert 2 <= len(short.token_ids) <= 15 and took < 1.0, (len(short.token_ids), took)
    assert short.token_ids == greedy(model, ctx, len(short.token_ids))
    assert late.token_ids == greedy(model, ctx, 1)  # past its time already: one step, one token
    assert whole.token_ids == greedy(model, ctx, 12)
