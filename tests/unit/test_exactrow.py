"""The exact one-token attention kernel (csrc/exact_row.cpp, exactrow.py): where this machine's probe
keeps it, it is HF's SDPA call bit for bit on draws the probe never saw (other seeds, slot counts
across every loop edge and 512-slot block, grouped shapes of the models we serve, pool views with
other strides), its logsumexp is the flash op's, and a one-token engine step with it equals the step
on HF's call. Where the probe refuses it (another CPU, BLAS or torch build), the engine never
calls it, which is asserted instead."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specmesh.engine import attention, exactrow
from specmesh.engine.rowprobe import _wide

# SmolLM2-135M, Qwen2.5 0.5B / 1.5B, no grouping; a kv head's query heads run in passes of <= 4
# together (3, 4 + 3, 3 + 3, 1 here; then 4, 3 + 2)
SHAPES = [(9, 3, 64), (14, 2, 64), (12, 2, 128), (4, 4, 64), (8, 2, 64), (10, 2, 64)]
LENGTHS = [1, 5, 16, 30, 33, 80, 96, 97, 300, 512, 514, 1030, 1537, 2300]

pytestmark = pytest.mark.skipif(exactrow._ext() is None, reason="the exact kernel is not built here (no AVX-512)")


def _kept(heads, kv_heads, d) -> bool:
    exactrow.configure(True)
    return exactrow.ok("cpu", torch.bfloat16, heads, kv_heads, d, d**-0.5)


@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
def test_kernel_is_hf_call_bitwise_where_the_probe_keeps_it(heads, kv_heads, d):
    if not _kept(heads, kv_heads, d):
        pytest.skip(f"the probe refused the kernel on this machine: {exactrow.decisions()}")
    gen = torch.Generator().manual_seed(1234 + d + heads)
    like = torch.empty(0, dtype=torch.bfloat16)
    ext = exactrow._ext()
    for length in LENGTHS:
        for spread in (0.3, 1.0, 3.0):
            q = (torch.randn(1, heads, 1, d, generator=gen) * spread).bfloat16()
            k = (torch.randn(1, kv_heads, length, d, generator=gen) * spread).bfloat16()
            v = _wide((kv_heads * length, d), like, gen).reshape(1, kv_heads, length, d)
            lse = torch.empty(heads)
            got = ext.exact_row(q, k, v, d**-0.5, lse)
            want = F.scaled_dot_product_attention(q, k, v, scale=d**-0.5, enable_gqa=heads != kv_heads)
            assert torch.equal(got, want), (length, spread)
            group = heads // kv_heads
            ref = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), 0.0, False, attn_mask=None,
                scale=d**-0.5)[1]
            assert torch.equal(lse, ref.reshape(heads)), (length, spread)


def test_kernel_reads_pool_views_in_place():
    """A sequence's slots inside a pool layer [KV, S, D]: slot and head strides not the view's own."""
    if not _kept(9, 3, 64):
        pytest.skip("the probe refused the kernel on this machine")
    gen = torch.Generator().manual_seed(5)
    pool_k = torch.randn(3, 3000, 64, generator=gen).bfloat16()
    pool_v = _wide((3 * 3000, 64), torch.empty(0, dtype=torch.bfloat16), gen).reshape(3, 3000, 64)
    q = torch.randn(1, 12, 9, 64, generator=gen).bfloat16().transpose(1, 2)[:, :, 4:5]  # a strided query row
    for start, length in ((0, 1), (17, 513), (1000, 1999)):
        k, v = pool_k[None, :, start : start + length], pool_v[None, :, start : start + length]
        want = F.scaled_dot_product_attention(q, k, v, scale=0.125, enable_gqa=True)
        assert torch.equal(exactrow.run(q, k, v, 0.125), want)
        assert torch.equal(attention.sdpa(q, k, v, None, False, 0.125), want)  # whichever call sdpa takes


def test_kernel_rejects_what_it_does_not_compute():
    ext = exactrow._ext()
    q, k = torch.randn(1, 9, 1, 64).bfloat16(), torch.randn(1, 3, 10, 64).bfloat16()
    with pytest.raises(RuntimeError, match="bf16 only"):
        ext.exact_row(q.float(), k.float(), k.float(), 0.125, None)
    with pytest.raises(RuntimeError, match="q \\[1, H, 1, D\\]"):
        ext.exact_row(torch.randn(1, 9, 2, 64).bfloat16(), k, k, 0.125, None)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ext.exact_row(torch.randn(1, 9, 1, 40).bfloat16(), k[..., :40], k[..., :40], 0.125, None)


def test_decisions_are_per_shape_and_off_when_disabled():
    assert not exactrow.ok("cpu", torch.float32, 9, 3, 64, 0.125)  # bf16 rows only
    assert not exactrow.ok("cpu", torch.bfloat16, 9, 3, 40, 0.125)  # head dim not a multiple of 16
    try:
        exactrow.configure(False)
        assert not exactrow.ok("cpu", torch.bfloat16, 9, 3, 64, 0.125)
        assert exactrow.decisions() == {}
    finally:
        exactrow.configure(True)
    kept = exactrow.ok("cpu", torch.bfloat16, 9, 3, 64, 0.125)
    assert exactrow.decisions() == {"bfloat16 9x3x64": kept}


def test_engine_one_token_steps_equal_hf_call_steps():
    """A one-token decode step of the engine with the kernel gives the logits of the same step on HF's
    call, bit for bit (a small random Llama in bf16, 9 x 3 heads of 64, ~600 slots)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specmesh.engine.kv import batched_step
    from specmesh.engine.pool import new_pool

    if not _kept(9, 3, 64):
        pytest.skip("the probe refused the kernel on this machine")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=576, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048))
    model = model.bfloat16().eval()
    prompt = torch.randint(0, 128, (600,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = []
    for enabled in (True, False):
        exactrow.configure(enabled)
        attention.configure(False)  # HF's call where the kernel is off (no fold on either side)
        try:
            assert attention.one_token_mode("cpu", torch.bfloat16, 9, 3, 64, None) == (2 if enabled else 0)
            pool = new_pool(model, 4096)
            kv = pool.allocate(len(prompt) + 8)
            batched_step(model, [kv], [prompt], logits_rows=[[len(prompt) - 1]])
            kv.commit(len(prompt))
            logits = []
            for token in (5, 17, 99):
                logits.append(batched_step(model, [kv], [[token]])[0].logits)
                kv.commit(1)
            runs.append(torch.cat(logits))
        finally:
            exactrow.configure(True)
            attention.configure("auto")
    assert torch.equal(runs[0], runs[1])
