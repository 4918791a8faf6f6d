"""rowexact and the pool attention on a tiny random Llama (the bitwise claims on the real model
are in tests/model/test_row_exact.py): the install guard, an installed model is HF's own
computation outside a deterministic step, chunked linears within the probed count, sliding
windows kept exact, and the probe's row-count search."""

from __future__ import annotations

import types

import pytest
import torch

from specmesh.engine import rowexact
from specmesh.engine.kv import batched_step
from specmesh.engine.pool import new_sequence_kv


def _tiny(**extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **extra)
    return LlamaForCausalLM(cfg).float().eval()


def test_row_exact_refused_without_install(prefilled):
    model = _tiny()
    kv = prefilled(model, [3, 4, 5])
    with pytest.raises(RuntimeError, match="install"):
        batched_step(model, [kv], [[1, 2]], row_exact=True)


def test_installed_model_is_unchanged_without_row_exact_and_exact_with_it(prefilled, one_token_steps):
    plain, installed = _tiny(), rowexact.install(_tiny())
    assert rowexact.install(installed) is installed and rowexact.is_installed(installed)
    prompt, drafts = [3, 9, 4, 17, 8], [5, 6, 7]
    a = batched_step(plain, [prefilled(plain, prompt)], [drafts])[0].logits
    b = batched_step(installed, [prefilled(installed, prompt)], [drafts])[0].logits
    assert torch.equal(a, b)  # same weights (seed 0), not row-exact: HF's own linears
    exact = batched_step(installed, [prefilled(installed, prompt)], [drafts], row_exact=True)[0].logits
    assert torch.equal(exact, one_token_steps(installed, prompt, drafts))


def test_pool_attention_matches_hf_for_a_packed_batch_of_different_lengths():
    """Three sequences (cache 5, 0 and 9 tokens; 3, 4 and 1 new) in one packed step: each one's
    logits are HF's full forward of its whole text, and the pool holds exactly its KV."""
    model = _tiny()
    texts = [[3, 9, 4, 17, 8, 5, 6, 7], [11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
    cached = [5, 0, 9]
    kvs = [new_sequence_kv(model, 4) for _ in texts]  # private pools: grow as needed
    for kv, t, c in zip(kvs, texts, cached):
        if c:
            batched_step(model, [kv], [t[:c]])
            kv.commit(c)
    outs = batched_step(model, kvs, [t[c:] for t, c in zip(texts, cached)])
    for kv, t, c, out in zip(kvs, texts, cached, outs):
        with torch.inference_mode():
            ref = model(torch.tensor([t])).logits[0, c:].float()
        assert torch.allclose(out.logits, ref, atol=1e-4)
        kv.commit(len(t) - c)
        assert kv.length == len(t)


def test_hf_generate_on_an_attached_model_is_unchanged():
    """attach() reroutes attention only inside a step: HF generate on the same model object, with
    left padding (its own masks), gives what it gave before the model served a step."""
    model = _tiny()
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.inference_mode():
        before = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    kv = new_sequence_kv(model, 8)
    batched_step(model, [kv], [[1, 2, 3]])
    with torch.inference_mode():
        after = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(before, after)


def test_sliding_window_models_stay_inside_their_window():
    """The pool attention reads every slot; a model with an active sliding window is therefore
    served only inside that window, where full attention is exactly sliding attention."""
    from transformers import MistralConfig, MistralForCausalLM

    from specmesh.core.types import SamplingParams
    from specmesh.errors import InvalidArgument
    from target_worker.engine import TargetEngine

    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    engine = TargetEngine(MistralForCausalLM(cfg).eval(), 4, 4, 256, 60)
    try:
        assert engine.context_window == 16
        with pytest.raises(InvalidArgument, match="window"):
            engine.prefill("s", list(range(1, 17)), SamplingParams(temperature=0.0), timeout=60)
    finally:
        engine.close()


def test_invariant_rows_finds_the_first_row_count_that_changes_the_result():
    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    rows = torch.randn(9, 3, generator=torch.Generator().manual_seed(2))

    def per_row(x):  # row by row: invariant by construction (a real small GEMM may not be: MKL)
        return torch.stack([r @ w.T for r in x])

    def drifts_from(m0):  # a "GEMM" whose kernel changes (and rounds differently) from m0 rows on
        return lambda x: per_row(x) + (1e-3 if x.shape[0] >= m0 else 0.0)

    assert rowexact.invariant_rows(per_row, rows) == 8
    assert rowexact.invariant_rows(drifts_from(4), rows) == 3
    assert rowexact.invariant_rows(drifts_from(2), rows) == 1
    calls = iter(range(100))
    assert rowexact.invariant_rows(lambda x: x @ w.T + next(calls), rows) == 0  # not even M=1 repeats


def test_linears_run_in_chunks_of_their_probed_row_count(monkeypatch, prefilled, one_token_steps):
    """A probed count of 0 forces one-row calls, 2 chunks of two, 64 one batched call; each is exact
    only where the probe said so -- the counts install found are what the worker runs with."""
    model = rowexact.install(_tiny())
    linears = [m for m in model.model.modules() if isinstance(m, torch.nn.Linear)]
    assert all(isinstance(m._specmesh_rows, int) for m in linears)
    assert set(rowexact.probed(model)) >= {"lm_head float32"}
    prompt, drafts = [3, 9, 4, 17, 8], [5, 6, 7]
    shapes = []
    real_linear = torch.nn.functional.linear

    head = model.get_output_embeddings().weight

    def spy(x, w, b=None):
        if w is not head:  # the decoder's linears (the head has its own probed count: kv.lm_head)
            shapes.append(tuple(x.shape[:-1]))
        return real_linear(x, w, b)

    monkeypatch.setattr(rowexact.F, "linear", spy)
    for rows, expect in ((0, [(1,)] * 3), (2, [(2,), (1,)]), (64, [(3,)])):
        for m in linears:
            m._specmesh_rows = rows
        kv = prefilled(model, prompt)
        shapes.clear()
        out = batched_step(model, [kv], [drafts], row_exact=True)[0].logits
        assert shapes == expect * len(linears)
        if rows <= 1 or all(rowexact.probe_rows(m.weight, m.bias, rows) >= rows for m in linears):
            assert torch.equal(out, one_token_steps(model, prompt, drafts))


def test_auto_is_deterministic_exactly_where_the_probe_finds_hf_kernels_cheap(monkeypatch):
    """auto: HF's one-row kernels where they batch (mode 1), else off, even where the 2-row floor
    would batch (own kernels: one key away, `own` -> mode 2); the floor is probed only where the
    one-row count is short."""
    from target_worker.engine import resolve_batch_invariant

    model = _tiny()
    cheap = rowexact.CHEAP_ROWS
    for one, two, expect in ((cheap, 0, 1), (1, 64, 0), (0, cheap, 0), (1, cheap - 1, 0), (0, 0, 0)):
        floors = []

        def fake(*a, floor=1, one=one, two=two, **k):
            floors.append(floor)
            return two if floor == 2 else one

        monkeypatch.setattr(rowexact, "probe_rows", fake)
        model._specmesh_row_exact = False
        assert resolve_batch_invariant(model, "auto") == expect, (one, two)
        assert (2 in floors) == (one < cheap)
        assert resolve_batch_invariant(model, "own") == 2
        assert rowexact.cheap(model, 2) == (max(one, two) >= cheap)
    assert resolve_batch_invariant(model, True) == 1 and resolve_batch_invariant(model, False) == 0


def test_auto_is_off_off_the_cpu(monkeypatch):
    """Off a CPU the per-row attention calls make the mode dear whatever the linears probe (an
    H200: 1.9x at 9 positions), so auto is off there and `true` / `own` still switch it on."""
    from target_worker.engine import resolve_batch_invariant

    model = _tiny()
    monkeypatch.setattr(rowexact, "probe_rows", lambda *a, **k: 64)
    assert resolve_batch_invariant(model, "auto") == 1 and rowexact.cheap(model, 1)
    meta = types.SimpleNamespace(device=torch.device("meta"))
    monkeypatch.setattr(type(model), "parameters", lambda self, recurse=True: iter([meta]))
    assert resolve_batch_invariant(model, "auto") == 0 and rowexact.cheap(model, 1)
    assert resolve_batch_invariant(model, True) == 1 and resolve_batch_invariant(model, "own") == 2


def test_two_row_floor_where_one_row_products_run_a_kernel_of_their_own(monkeypatch, prefilled, one_token_steps):
    """A 'GEMV' that rounds one-row products differently from every batched call (as bf16
    576x1536 does on a Zen 4 EPYC): the one-row probe finds no rows, the 2-row-floor probe its
    limit: the mode is cheap with the mesh's own kernels only. There no call has fewer than 2 rows,
    the one-token decode included, so a verify is bitwise that mode's one-token steps (and not HF's
    one-row decode)."""
    real = torch.nn.functional.linear

    def gemv(x, w, b=None):  # batched: each row alone (row-invariant by construction); one row: apart
        x2 = x.reshape(-1, x.shape[-1])
        out = torch.cat([real(r[None], w, b) for r in x2]).view(*x.shape[:-1], -1)
        return out + 1e-3 if x2.shape[0] == 1 else out

    monkeypatch.setattr(rowexact.F, "linear", gemv)
    model = rowexact.install(_tiny())
    assert rowexact.cheap(model, 2) and not rowexact.cheap(model, 1) and rowexact.auto_mode(model) == 0
    assert rowexact.probed(model, 2) == {
        **{f"{n}x{m} float32 (2-row floor)": rowexact.PROBE_ROWS for n, m in ((32, 32), (16, 32), (64, 32), (32, 64))},
        "LlamaRMSNorm 32 float32": rowexact.PROBE_ROWS, "lm_head float32 (2-row floor)": rowexact.PROBE_HEAD_ROWS}
    prompt, drafts = [3, 9, 4, 17, 8], [5, 6, 7]
    calls = []

    def spy(x, w, b=None):
        calls.append(x.reshape(-1, x.shape[-1]).shape[0])
        return gemv(x, w, b)

    monkeypatch.setattr(rowexact.F, "linear", spy)
    ref = one_token_steps(model, prompt, drafts, row_exact=2)
    kv = prefilled(model, prompt)
    del calls[:]
    exact = batched_step(model, [kv], [drafts], row_exact=2)[0].logits
    one = batched_step(model, [kv], [drafts[:1]], row_exact=2)[0].logits  # a one-token step in mode 2
    assert calls and min(calls) >= 2  # every product of the verify and of the one-token step: >= 2 rows
    assert torch.equal(one, ref[:1])
    assert torch.equal(exact, ref)
    assert torch.equal(batched_step(model, [prefilled(model, prompt)], [drafts], row_exact=1)[0].logits,
                       one_token_steps(model, prompt, drafts, row_exact=1))  # mode 1: one row per call
    assert not torch.equal(exact, one_token_steps(model, prompt, drafts))  # HF's one-row decode rounds apart


def test_norms_run_in_chunks_of_their_probed_row_count(monkeypatch, prefilled, one_token_steps):
    """A norm whose reduction sums a row in another order once it has company (as a GPU's
    reduction kernel may split few rows differently from many): the probe finds 1 row, steps then
    run it row by row and a verify stays bitwise the one-token steps; with the count forced to
    its limit the same verify moves (so the chunking, not luck, keeps it exact)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    real = LlamaRMSNorm.forward

    def split_sum(self, x):  # one row: HF's; several: a drift, as another summation order rounds
        out = real(self, x)
        return out if x.reshape(-1, x.shape[-1]).shape[0] == 1 else out * (1 + 2**-10)

    monkeypatch.setattr(LlamaRMSNorm, "forward", split_sum)
    model = rowexact.install(_tiny())
    norms = [m for m in model.model.modules() if isinstance(m, LlamaRMSNorm)]
    assert norms and {m._specmesh_rows for m in norms} == {1}
    assert rowexact.probed(model)["LlamaRMSNorm 32 float32"] == 1 and not rowexact.cheap(model)
    prompt, drafts = [3, 9, 4, 17, 8], [5, 6, 7]
    ref = one_token_steps(model, prompt, drafts)
    assert torch.equal(batched_step(model, [prefilled(model, prompt)], [drafts], row_exact=True)[0].logits, ref)
    for m in norms:
        m._specmesh_rows = rowexact.PROBE_ROWS
    assert not torch.equal(batched_step(model, [prefilled(model, prompt)], [drafts], row_exact=True)[0].logits, ref)


def test_a_norm_without_a_weight_is_left_whole():
    """A LayerNorm without affine parameters gives the probe no dtype or width to draw from: it is
    not probed, not wrapped, and install still probes the rest."""
    import torch.nn as nn

    model = _tiny()
    model.model.norm = nn.LayerNorm(32, elementwise_affine=False)
    rowexact.install(model)
    assert not hasattr(model.model.norm, "_specmesh_rows") and "forward" not in vars(model.model.norm)
    assert any(k.startswith("LlamaRMSNorm") for k in rowexact.probed(model))


def test_a_prepacked_head_is_probed_on_past_its_limit_only_where_the_mode_is_cheap(monkeypatch):
    """_extend_head: a prepacked LM head that held to PROBE_HEAD_ROWS is probed on to
    PROBE_PACKED_ROWS (and takes what that finds, smaller too) where the deterministic mode is
    cheap; not where the head is not prepacked, fell short, or the decoder makes the mode costly."""
    from specmesh.engine import onednn

    model = _tiny()
    head_w = model.get_output_embeddings().weight
    limit, extended = rowexact.PROBE_HEAD_ROWS, rowexact.PROBE_PACKED_ROWS
    for packed, head, decoder, found, expect in ((True, limit, 64, extended, extended),
                                                  (True, limit, 64, 16, 16),
                                                  (False, limit, 64, extended, limit),
                                                  (True, 16, 64, extended, 16),
                                                  (True, limit, 2, extended, limit)):
        asked = []

        def fake(weight, bias, max_rows, *a, floor=1, head=head, decoder=decoder, found=found, **k):
            if weight is not head_w:
                return decoder
            asked.append(max_rows)
            return found if max_rows == extended else head

        monkeypatch.setattr(rowexact, "probe_rows", fake)
        monkeypatch.setattr(onednn, "is_packed", lambda mod, packed=packed: packed)
        model._specmesh_row_exact = False
        rowexact.install(model)
        assert model._specmesh_head_rows == expect, (packed, head, decoder, found)
        assert (extended in asked) == (packed and head >= limit and decoder >= rowexact.CHEAP_ROWS)
