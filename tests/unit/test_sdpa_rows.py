"""The deterministic mode's per-row attention on torch's SDPA (csrc/sdpa_rows.cpp, kv._rows_exact):
the extension's loop makes the very calls of the Python loop, so its rows are bitwise the Python
loop's, for chains and trees (a row's path written where it differs from the previous row's),
grouped heads folded or not, bf16 and float32; a tree's slots are put back as they were."""

from __future__ import annotations

import pytest
import torch

from specmesh.core.tree import tree_layout
from specmesh.engine import attention, cpu_gemm, exactrow, kv, rowgroup

pytestmark = pytest.mark.skipif(cpu_gemm.load() is None, reason=f"extension not usable here: {cpu_gemm.unusable_reason()}")


def _case(dtype, heads, kv_heads, d, length, n, seed):
    gen = torch.Generator().manual_seed(seed)
    pool_k = (torch.randn(kv_heads, length + n + 7, d, generator=gen) * 3).to(dtype)  # a pool layer
    pool_v = (torch.randn(kv_heads, length + n + 7, d, generator=gen) * 3).to(dtype)
    # the engine's query layout: [1, T, heads, D] transposed to [1, heads, T, D], this sequence at rows 2..
    q = (torch.randn(1, n + 4, heads, d, generator=gen)).to(dtype).transpose(1, 2)[:, :, 2 : 2 + n]
    return q, pool_k, pool_v


def _paths(parents):
    mask, _ = tree_layout(parents)
    ancestors = mask.nonzero()
    off = torch.zeros(mask.shape[0] + 1, dtype=torch.long)  # [pending, drafts]
    off[1:] = mask.sum(1).cumsum(0)
    return ancestors[:, 1].contiguous(), off


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("one", [0, 1, 2], ids=["hf-call", "folded", "exact"])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("kv_heads", [3, 1])  # one kv head: a tree's slots are a contiguous run (copied, not aliased)
@pytest.mark.parametrize("grouped", [False, True])  # rows in one call where rowgroup's probe keeps a width
def test_extension_rows_are_bitwise_the_python_loop(monkeypatch, dtype, one, tree, kv_heads, grouped):
    if one == 2 and (dtype != torch.bfloat16 or exactrow._ext() is None):
        pytest.skip("the exact kernel takes bf16 rows, where built (AVX-512)")
    fold = one == 1
    heads, d, length = 9, 64, 261
    parents = [-1, 0, 0, 1, 3, 2, 0, 6]
    n = len(parents) + 1  # the pending token, then the drafts
    q, pool_k, pool_v = _case(dtype, heads, kv_heads, d, length, n, seed=7 + fold + 2 * tree)
    paths = _paths(parents) if tree else None
    monkeypatch.setattr(kv, "one_token_mode", lambda *a: one)
    monkeypatch.setattr(attention, "one_token_mode", lambda *a: one)
    monkeypatch.setattr(rowgroup, "ENABLED", grouped)
    outs, pools = [], []
    for use_ext in (True, False):
        k, v = pool_k.clone(), pool_v.clone()
        before = k.clone()
        monkeypatch.setattr(cpu_gemm, "load", (lambda real: (lambda: real) if use_ext else (lambda: None))(cpu_gemm._EXT))
        out = torch.empty(n, heads, d, dtype=dtype)
        view_k, view_v = k[None, :, 3 : 3 + length + n], v[None, :, 3 : 3 + length + n]  # the sequence at slot 3
        kv._rows_exact(q, view_k, view_v, length, paths, 0.125, out)
        assert torch.equal(k, before), "the tree's slots are put back"
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    # and each row is its own one-token call over the slots it sees
    j = n - 1
    seen = _paths(parents)[0][_paths(parents)[1][j]:] + length if tree else torch.arange(length, length + n)
    slots = torch.cat([torch.arange(length), seen]) + 3
    row = attention.sdpa(q[:, :, j : j + 1], pool_k[None, :, slots], pool_v[None, :, slots], None, False, 0.125)
    assert torch.equal(outs[0][j], row[0, :, 0])


def test_extension_rejects_a_path_that_is_not_a_tree():
    """Row 2's path claims row 1 as its ancestor, but row 1's own path is not a prefix of it."""
    ext = cpu_gemm.load()
    q, pool_k, pool_v = _case(torch.bfloat16, 9, 3, 64, 20, 3, seed=1)
    k, v = pool_k[None, :, :23], pool_v[None, :, :23]
    before = k.clone()
    flat, off = torch.tensor([0, 1, 0, 2, 1]), torch.tensor([0, 1, 3, 5])  # rows 0; 0 1; 2 1 (bad)
    with pytest.raises(RuntimeError, match="sdpa rows"):
        ext.sdpa_rows(q, k, v, 20, flat, off, None, False, 16, torch.empty(3, 9, 64, dtype=torch.bfloat16))
    # each path ends at its row, but row 3 claims parent 2 over a path (0 1) that is not row 2's (0 2)
    q4, pool_k4, pool_v4 = _case(torch.bfloat16, 9, 3, 64, 20, 4, seed=2)
    k4, v4 = pool_k4[None, :, :24], pool_v4[None, :, :24]
    before4 = k4.clone()
    flat4, off4 = torch.tensor([0, 0, 1, 0, 2, 0, 1, 2, 3]), torch.tensor([0, 1, 3, 5, 9])
    with pytest.raises(RuntimeError, match="each ancestor's path a prefix"):
        ext.sdpa_rows(q4, k4, v4, 20, flat4, off4, None, False, 16, torch.empty(4, 9, 64, dtype=torch.bfloat16))
    assert torch.equal(k, before) and torch.equal(k4, before4), "checked before any slot moves"


def test_extension_rejects_bad_shapes():
    ext = cpu_gemm.load()
    q = torch.randn(1, 9, 3, 64)
    k = torch.randn(1, 3, 10, 64)
    with pytest.raises(RuntimeError, match="sdpa rows"):
        ext.sdpa_rows(q, k, k, 5, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), None, False,
                      0, torch.empty(3, 9, 64))
