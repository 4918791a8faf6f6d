"""The engine's attention call: a one-token row folded (grouped heads as rows) where the probe
finds that bitwise HF's call and not slower, or where target_worker.attention_fold forces it."""

import pytest
import torch

from specmesh.engine import attention


@pytest.fixture(autouse=True)
def fresh_setting(monkeypatch):
    monkeypatch.setattr(attention, "_gain", lambda *a: 9.0)  # true folds what the probe finds faster
    attention.configure("auto")
    yield
    attention.configure("auto")


def _row(dtype, heads=9, kv_heads=3, d=64, length=300, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, 1, d, generator=gen).to(dtype)
    k = (torch.randn(1, kv_heads, length, d, generator=gen) * 2).to(dtype)
    v = torch.randn(1, kv_heads, length, d, generator=gen).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 40, 700, 2300])
def test_forced_off_a_one_token_row_is_bitwise_hfs_call_and_on_it_is_the_same_attention(dtype, length):
    q, k, v = _row(dtype, length=length, seed=length)
    hf = attention._hf_call(q, k, v, None, False, 0.125)
    attention.configure(False)
    assert torch.equal(attention.sdpa(q, k, v, None, False, 0.125), hf)
    attention.configure(True)
    folded = attention.sdpa(q, k, v, None, False, 0.125)
    assert torch.equal(folded, attention._folded(q, k, v, 0.125))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(folded.float(), hf.float(), atol=tol, rtol=tol)
    assert not torch.equal(folded, torch.zeros_like(folded))


def test_the_folded_layout_computes_attention_per_head():
    q, k, v = _row(torch.float32, length=50)
    want = torch.cat([torch.softmax(q[0, h, 0] @ k[0, h // 3].T * 0.125, -1)[None] @ v[0, h // 3] for h in range(9)])
    assert torch.allclose(attention._folded(q, k, v, 0.125)[0, :, 0], want, atol=1e-5)


@pytest.mark.parametrize("exact, gain, folds", [(True, 1.0, True), (True, 3.0, True), (True, 0.8, False),
                                                (False, 5.1, False)])
def test_auto_folds_only_what_is_bitwise_hfs_call_and_not_slower(monkeypatch, exact, gain, folds):
    monkeypatch.setattr(attention, "_equal", lambda *a: exact)
    monkeypatch.setattr(attention, "_gain", lambda *a: gain)
    assert attention.fold_ok("cpu", torch.bfloat16, 9, 3, 64, 0.125) is folds
    assert attention.decisions() == {"bfloat16 9x3x64 on cpu": folds}
    attention.configure(True)
    assert attention.fold_ok("cpu", torch.bfloat16, 9, 3, 64, 0.125) is (gain >= attention.FAST_GAIN)
    attention.configure(False)
    assert attention.fold_ok("cpu", torch.bfloat16, 9, 3, 64, 0.125) is False


def test_the_equality_probe_refuses_a_layout_that_differs_in_one_bit(monkeypatch):
    real = attention._folded

    def off_by_one_ulp(q, k, v, scale):
        out = real(q, k, v, scale)
        out.view(-1)[5] = torch.nextafter(out.view(-1)[5], torch.tensor(float("inf"), dtype=out.dtype))
        return out

    monkeypatch.setattr(attention, "_folded", off_by_one_ulp)
    assert attention._equal("cpu", torch.float32, 9, 3, 64, 0.125) is False
    monkeypatch.setattr(attention, "_folded", lambda q, k, v, s: attention._hf_call(q, k, v, None, False, s))
    assert attention._equal("cpu", torch.float32, 9, 3, 64, 0.125) is True


def test_rows_with_a_mask_several_rows_and_plain_heads_keep_hfs_call(monkeypatch):
    attention.configure(True)
    monkeypatch.setattr(attention, "_folded", lambda *a: pytest.fail("folded a call it must not fold"))
    q, k, v = _row(torch.bfloat16)
    attention.sdpa(q, k, v, torch.ones(1, 300, dtype=torch.bool), False, 0.125)
    attention.sdpa(torch.cat([q, q], 2), k, v, None, True, 0.125)
    attention.sdpa(q[:, :3], k, v, None, False, 0.125)  # as many heads as kv heads: nothing to fold
    assert attention.fold_ok("cpu", torch.bfloat16, 3, 3, 64, 0.125) is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_a_deterministic_verify_is_still_bitwise_the_target_alone(dtype, prefilled, one_token_steps):
    """attention_fold true: the one-token steps and every row of a deterministic chain or tree
    verify take the folded call alike, so the verify's logits are the target alone's, bit for bit."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specmesh.core.tree import tree_layout
    from specmesh.engine import rowexact
    from specmesh.engine.kv import batched_step

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256)
    model = rowexact.install(LlamaForCausalLM(cfg).to(dtype).eval())
    attention.configure(True)
    prompt = [int(x) for x in torch.randint(0, 64, (70,))]
    chain = [5, 6, 7, 8]
    got = batched_step(model, [prefilled(model, prompt)], [chain], row_exact=True)[0].logits
    assert torch.equal(got, one_token_steps(model, prompt, chain))
    mask, depths = tree_layout([-1, -1, 0])  # pending 5; drafts 6 and 9 under it, 7 under 6
    tree = batched_step(model, [prefilled(model, prompt)], [[5, 6, 9, 7]], new_masks=[mask], depths=[depths],
                        row_exact=True)[0].logits
    assert torch.equal(tree[[0, 1, 3]], one_token_steps(model, prompt, [5, 6, 7]))
    assert torch.equal(tree[2], one_token_steps(model, prompt, [5, 9])[1])
    assert attention.decisions() == {f"{str(dtype).replace('torch.', '')} 6x2x8 on cpu": True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steps_additive_mask_is_bitwise_the_bool_mask_sdpa_converts_each_call(dtype):
    """step_mask makes once per step the mask torch's SDPA makes of a bool mask per call (0
    visible, -inf not, in the query's dtype): a chain's and a tree's rows attend bitwise alike."""
    from specmesh.core.tree import tree_layout

    gen = torch.Generator().manual_seed(3)
    n, length = 9, 270
    q = torch.randn(1, 9, n, 64, generator=gen).to(dtype)
    k, v = ((torch.randn(1, 3, length + n, 64, generator=gen) * 3).to(dtype) for _ in range(2))
    tree, _ = tree_layout([-1, 0, 0, 1, 1, 2, 4, 6])  # [pending, 8 nodes]: 9 rows
    for new in (torch.ones(n, n, dtype=torch.bool).tril(), tree):
        visible = torch.cat([torch.ones(n, length, dtype=torch.bool), new], 1)
        add = attention.step_mask(new, length, dtype)
        assert add.dtype == dtype and torch.equal(add == 0, visible) and bool(torch.isinf(add[~visible]).all())
        assert torch.equal(attention._hf_call(q, k, v, visible, False, 0.125),
                           attention._hf_call(q, k, v, add, False, 0.125))
