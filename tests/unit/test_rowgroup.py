"""Deterministic chain rows grouped into one SDPA call (csrc/sdpa_rows.cpp, engine/rowgroup.py):
every grouped row is bitwise its own one-token call wherever the probe keeps a width, on draws
other than the probe's (other seeds, other strides, GQA and not, folded and not, bf16 and float32);
a width the kernel's vectors do not match is caught by the probe; and the model's deterministic
verify rows equal its one-token steps with the groups in use."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine import cpu_gemm, rowgroup

pytestmark = pytest.mark.skipif(cpu_gemm.load() is None, reason=f"extension not usable here: {cpu_gemm.unusable_reason()}")

NO = torch.empty(0, dtype=torch.long)


def _rows(width, q, k, v, length, fold, scale=0.125):
    out = torch.empty(q.shape[2], q.shape[1], q.shape[3], dtype=q.dtype)
    cpu_gemm.load().sdpa_rows(q, k, v, length, NO, NO, scale, fold, width, out)
    return out


def _case(dtype, heads, kv_heads, d, length, n, seed):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(1, n + 3, heads, d, generator=gen) * 1.5).to(dtype).transpose(1, 2)[:, :, 1 : 1 + n]
    k = (torch.randn(kv_heads, length + n + 9, d, generator=gen) * 1.5).to(dtype)
    v = (torch.randn(kv_heads, length + n + 9, d, generator=gen) * torch.exp2(
        torch.randint(-8, 9, (kv_heads, length + n + 9, 1), generator=gen).float())).to(dtype)
    return q, k[None, :, 5 : 5 + length + n], v[None, :, 5 : 5 + length + n]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (12, 2, 128), (4, 4, 32)])
@pytest.mark.parametrize("fold", [False, True])
def test_grouped_rows_are_each_rows_own_call(dtype, heads, kv_heads, d, fold):
    if fold and heads == kv_heads:
        pytest.skip("folding needs grouped heads")
    width = rowgroup.width("cpu", dtype, heads, kv_heads, d, 0.125, fold)
    if not width:
        pytest.skip("the probe kept no group width on this CPU (one call per row)")
    for length in (0, 3, 14, 15, 16, 40, 261, 509, 511, 700):
        for n in (2, 5, 9, 17):
            q, k, v = _case(dtype, heads, kv_heads, d, length, n, seed=length * 31 + n)
            assert torch.equal(_rows(width, q, k, v, length, fold), _rows(0, q, k, v, length, fold)), (length, n)


def test_a_width_past_the_kernels_vectors_is_not_bitwise_and_the_probe_says_so():
    """A group of rows whose slot counts straddle a vector block sums in another order: width 64
    groups rows the kernel splits differently, so some draw differs, and _probe never returns it."""
    ext = cpu_gemm.load()
    differs = [not rowgroup._equal(ext, 64, length, torch.bfloat16, 9, 3, 64, 0.125, False) for length in range(40, 56)]
    assert any(differs)
    assert rowgroup._probe(ext, torch.bfloat16, 9, 3, 64, 0.125, False) in rowgroup.WIDTHS + (0,)


def test_grouping_calls_fewer_kernels_than_rows():
    """The point of it: 5 chain rows that share a vector block are one SDPA call, not five."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = _case(torch.bfloat16, 9, 3, 64, 256, 5, seed=3)  # slots 257..261: one block of 16
    calls = {}
    for width in (0, 16):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _rows(width, q, k, v, 256, False)
        calls[width] = sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")
    assert calls == {0: 5, 16: 1}


def test_off_the_cpu_and_when_disabled_one_call_per_row(monkeypatch):
    assert rowgroup.width("meta", torch.bfloat16, 9, 3, 64, 0.125, False) == 0
    monkeypatch.setattr(rowgroup, "ENABLED", False)
    assert rowgroup.width("cpu", torch.bfloat16, 9, 3, 64, 0.125, False) == 0


def test_a_tree_goes_in_chains():
    """A tree of 8 drafts under the pending token in 3 root-to-leaf chains: with a width, a call per
    chain (its rows share a vector block), each row still its own call's bits (test_sdpa_rows)."""
    from torch.profiler import ProfilerActivity, profile

    from specmesh.core.tree import tree_layout

    mask, _ = tree_layout([-1, 0, 0, 1, 3, 2, 0, 6])  # rows [pending, drafts]: chains 0-1-7-8, 0-1-3-6, 0-1-2-4-5
    flat, off = mask.nonzero()[:, 1].contiguous(), torch.zeros(10, dtype=torch.long)
    off[1:] = mask.sum(1).cumsum(0)
    q, k, v = _case(torch.bfloat16, 9, 3, 64, 256, 9, seed=5)
    calls, outs = {}, {}
    for width in (0, 16):
        out = torch.empty(9, 9, 64, dtype=torch.bfloat16)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            cpu_gemm.load().sdpa_rows(q, k, v, 256, flat, off, 0.125, False, width, out)
        calls[width] = sum(e.count for e in prof.key_averages() if e.key == "aten::scaled_dot_product_attention")
        outs[width] = out
    assert calls == {0: 9, 16: 3}
    assert torch.equal(outs[0], outs[16])
