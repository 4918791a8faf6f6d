"""rowexact mechanics on a tiny random Llama (the bitwise claims on the real model in bf16 are in
tests/model/test_row_exact.py): the plan read off the verify mask, the install guard, the
sliding-window refusal, and that an installed model without a plan is HF's own computation."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine import rowexact
from specmesh.engine.kv import batched_step


def _tiny(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **extra)
    return LlamaForCausalLM(cfg).float().eval()


def test_plan_lists_each_real_query_rows_visible_slots():
    # B=2, Q=3, S=4+3: row 0 has a cache of 4 and 3 new tokens (causal); row 1 a cache of 2, 1 new
    mask = torch.zeros((2, 1, 3, 7), dtype=torch.bool)
    mask[0, 0, :, :4] = True
    mask[0, 0, :, 4:] = torch.tril(torch.ones(3, 3, dtype=torch.bool))
    mask[1, 0, :, :2] = True
    mask[1, 0, 0, 4] = True
    plan = rowexact.plan_from_mask(mask, [3, 1])
    assert plan.counts == [3, 1]
    assert [s.tolist() for s in plan.slots[0]] == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6]]
    assert [s.tolist() for s in plan.slots[1]] == [[0, 1, 4]]


def test_row_exact_refused_without_install(prefilled):
    model = _tiny()
    kv = prefilled(model, [3, 4, 5])
    with pytest.raises(RuntimeError, match="install"):
        batched_step(model, [kv], [[1, 2]], row_exact=True)


def test_installed_model_is_unchanged_without_a_plan_and_exact_with_one(prefilled, one_token_steps):
    plain, installed = _tiny(), rowexact.install(_tiny())
    assert rowexact.install(installed) is installed and rowexact.is_installed(installed)
    prompt, drafts = [3, 9, 4, 17, 8], [5, 6, 7]
    a = batched_step(plain, [prefilled(plain, prompt)], [drafts])[0].logits
    b = batched_step(installed, [prefilled(installed, prompt)], [drafts])[0].logits
    assert torch.equal(a, b)  # same weights (seed 0), no plan: HF's own path
    exact = batched_step(installed, [prefilled(installed, prompt)], [drafts], row_exact=True)[0].logits
    assert torch.equal(exact, one_token_steps(installed, prompt, drafts))


def test_sliding_window_models_are_refused():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    with pytest.raises(ValueError, match="sliding-window"):
        rowexact.install(MistralForCausalLM(cfg).eval())


def test_plan_is_used_when_nothing_needs_masking(monkeypatch, prefilled):
    """Two sequences of equal length, one new token each: the verify mask is all-visible (and is
    dropped for SDPA), but each row must still be computed alone."""
    model = rowexact.install(_tiny())
    kvs = [prefilled(model, [3, 4, 5]), prefilled(model, [6, 7, 8])]
    plans = []
    real = rowexact.active

    def spy(plan):
        plans.append(plan)
        return real(plan)

    monkeypatch.setattr(rowexact, "active", spy)
    batched_step(model, kvs, [[1], [2]], row_exact=True)
    assert len(plans) == 1 and plans[0].counts == [1, 1]
    assert [s.tolist() for s in plans[0].slots[0]] == [[0, 1, 2, 3]]
    batched_step(model, kvs[:1], [[1]], row_exact=True)  # a single row needs no plan
    assert len(plans) == 1


def test_invariant_rows_finds_the_first_row_count_that_changes_the_result():
    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    rows = torch.randn(8, 3, generator=torch.Generator().manual_seed(2))

    def drifts_from(m0):  # a "GEMM" whose kernel changes (and rounds differently) from m0 rows on
        return lambda x: x @ w.T + (1e-3 if x.shape[0] >= m0 else 0.0)

    assert rowexact.invariant_rows(lambda x: x @ w.T, rows) == 8
    assert rowexact.invariant_rows(drifts_from(4), rows) == 3
    assert rowexact.invariant_rows(drifts_from(2), rows) == 1
    calls = iter(range(100))
    assert rowexact.invariant_rows(lambda x: x @ w.T + next(calls), rows) == 0  # not even M=1 repeats


def test_linears_batch_only_within_their_probed_row_count(monkeypatch, prefilled, one_token_steps):
    """A probed count of 0 forces per-row calls, a large one the batched call; both are exact here
    only because the probe said so -- the counts install found are what the worker runs with."""
    model = rowexact.install(_tiny())
    linears = [m for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(isinstance(m._specmesh_rows, int) for m in linears)
    assert set(rowexact.probed(model)) >= {"lm_head float32"}
    prompt, drafts = [3, 9, 4, 17, 8], [5, 6, 7]
    shapes = []
    real_linear = torch.nn.functional.linear

    def spy(x, w, b=None):
        shapes.append(tuple(x.shape[:-1]))
        return real_linear(x, w, b)

    monkeypatch.setattr(rowexact.F, "linear", spy)
    for rows, expect in ((0, (1,)), (64, (3,))):
        for m in linears:
            m._specmesh_rows = rows
        kv = prefilled(model, prompt)
        shapes.clear()
        out = batched_step(model, [kv], [drafts], row_exact=True)[0].logits
        assert set(shapes) == {expect}
        if rows == 0 or all(rowexact.probe_rows(m.weight, m.bias, 3) >= 3 for m in linears):
            assert torch.equal(out, one_token_steps(model, prompt, drafts))
