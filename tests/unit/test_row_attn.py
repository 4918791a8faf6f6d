"""The row-attention kernel (csrc/row_attention.cpp, specmesh/engine/row_attn.py): each query row's
attention over exactly its slots, equal to torch SDPA within float32 rounding, bitwise the same
whatever other rows share the call, and, inside engine steps, a verify row (chain, tree, packed
batch, one pool or several) bitwise the one-token step that sees the same slots."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specmesh.core.tree import tree_layout
from specmesh.engine import cpu_gemm, row_attn

ext = cpu_gemm.load()
pytestmark = pytest.mark.skipif(ext is None, reason=f"kernel not usable here: {cpu_gemm.unusable_reason()}")


def _sdpa_row(q, k, v, slots, scale):
    """q: [H, D]; k, v: [KV, S, D]; slots: list -> [H, D] (HF's call: grouped heads by enable_gqa)."""
    idx = torch.tensor(slots)
    return F.scaled_dot_product_attention(q[None, :, None], k[:, idx][None], v[:, idx][None], scale=scale,
                                          enable_gqa=True)[0, :, 0]


def _call(q, k, v, rows, scale):
    """rows: per query row (start, length, extra slots) -> the kernel's [T, H, D]."""
    off = [0]
    for _, _, extra in rows:
        off.append(off[-1] + len(extra))
    longs = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return ext.row_attention(q, k, v, longs([r[0] for r in rows]), longs([r[1] for r in rows]), longs(off),
                             longs([s for r in rows for s in r[2]]), scale)


@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (12, 2, 128), (4, 4, 32)])
def test_matches_sdpa_and_each_row_is_bitwise_its_own_call(heads, kv_heads, d):
    gen = torch.Generator().manual_seed(heads * 100 + d)
    k, v = torch.randn(kv_heads, 700, d, generator=gen), torch.randn(kv_heads, 700, d, generator=gen) * 4
    rows = [(3, 1, []), (3, 250, []), (3, 251, []), (40, 9, [600, 601, 605]), (10, 0, [699]), (0, 640, [])]
    q = torch.randn(len(rows), heads, d, generator=gen) * 2
    scale = d**-0.5
    out = _call(q, k, v, rows, scale)
    for t, (start, length, extra) in enumerate(rows):
        slots = list(range(start, start + length)) + extra
        assert torch.allclose(out[t], _sdpa_row(q[t], k, v, slots, scale), atol=2e-5, rtol=1e-5), t
        assert torch.equal(_call(q[t : t + 1], k, v, [rows[t]], scale)[0], out[t]), t
    shuffled = [5, 0, 3, 1, 4, 2]  # another batch composition, another order: the same bits per row
    again = _call(q[shuffled], k, v, [rows[i] for i in shuffled], scale)
    assert torch.equal(again, out[shuffled])


def test_bf16_rows_are_the_float32_kernel_on_the_widened_values_rounded_once():
    """batch_invariant own: bf16 q / k / v are widened exactly (bf16 is float32's top half), the
    float32 arithmetic runs unchanged and the output is rounded to bf16 once; each row is still
    bitwise its own call. Mixed dtypes are refused."""
    gen = torch.Generator().manual_seed(7)
    k, v = torch.randn(3, 300, 64, generator=gen).bfloat16(), (torch.randn(3, 300, 64, generator=gen) * 4).bfloat16()
    rows = [(0, 1, []), (0, 256, []), (0, 257, []), (20, 30, [290, 291])]
    q = (torch.randn(len(rows), 9, 64, generator=gen) * 2).bfloat16()
    out = _call(q, k, v, rows, 0.125)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, _call(q.float(), k.float(), v.float(), rows, 0.125).bfloat16())
    for t, row in enumerate(rows):
        assert torch.equal(_call(q[t : t + 1], k, v, [row], 0.125)[0], out[t]), t
    with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
        _call(q, k.float(), v.float(), rows, 0.125)


def test_rows_that_see_no_slot_or_slots_past_the_pool_are_refused():
    k = v = torch.zeros(2, 10, 32)
    q = torch.zeros(1, 2, 32)
    for rows in ([(0, 0, [])], [(5, 6, [])], [(0, 2, [10])]):
        with pytest.raises(RuntimeError, match="row attention"):
            _call(q, k, v, rows, 0.1)
    with pytest.raises(RuntimeError, match="head dim"):
        ext.row_attention(torch.zeros(1, 2, 8), torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), torch.zeros(1).long(),
                          torch.ones(1).long(), torch.zeros(2).long(), torch.zeros(0).long(), 0.1)


@pytest.fixture(scope="module")
def tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).float().eval()
    assert cpu_gemm.install(model)
    return model


def _steps(model, kv, tokens):
    from specmesh.engine.kv import batched_step

    rows = []
    for t in tokens:
        rows.append(batched_step(model, [kv], [[t]])[0].logits[0])
        kv.commit(1)
    return torch.stack(rows)


def _prefilled(model, pool, prompt):
    from specmesh.engine.kv import batched_step

    kv = pool.allocate(len(prompt) + 40)
    batched_step(model, [kv], [prompt], logits_rows=[[len(prompt) - 1]])
    kv.commit(len(prompt))
    return kv


@pytest.mark.parametrize("shared", [True, False])
def test_verify_rows_of_a_packed_batch_are_bitwise_the_one_token_steps(tiny, shared):
    from specmesh.engine.kv import batched_step
    from specmesh.engine.pool import new_pool

    assert row_attn.usable(tiny, [new_pool(tiny, 8, private=True).allocate(4)])
    one = new_pool(tiny, 4096)
    pools = [one] * 3 if shared else [new_pool(tiny, 512) for _ in range(3)]
    prompts, drafts = [[5, 9, 2, 40, 7], [3] * 70, [11, 12]], [[4, 8, 15, 16, 23], [42], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    kvs = [_prefilled(tiny, pool, p) for pool, p in zip(pools, prompts)]
    outs = batched_step(tiny, kvs, drafts)
    for pool, prompt, draft, out in zip(pools, prompts, drafts, outs):
        assert torch.equal(out.logits, _steps(tiny, _prefilled(tiny, pool, prompt), draft))


def test_tree_rows_read_their_path_in_place_and_are_bitwise_their_path_steps(tiny):
    from specmesh.engine.kv import batched_step
    from specmesh.engine.pool import new_pool

    pool = new_pool(tiny, 2048)
    prompt, toks, parents = [7, 1, 30, 2, 9, 9], [10, 20, 30, 40, 50, 60, 70], [-1, 0, 0, 1, 1, 3, 2]
    mask, depth = tree_layout([p - 1 for p in parents[1:]])  # toks[0]: the pending token, the root
    kv = _prefilled(tiny, pool, prompt)
    out = batched_step(tiny, [kv], [toks], new_masks=[mask], depths=[depth])[0]
    for node in range(len(toks)):
        path, at = [], node
        while at >= 0:
            path.insert(0, toks[at])
            at = parents[at]
        ref = _steps(tiny, _prefilled(tiny, pool, prompt), path)
        assert torch.equal(out.logits[node], ref[-1]), node


def test_a_long_prefill_beside_decode_rows_keeps_sdpa_and_matches_its_own_step(tiny):
    from specmesh.engine.kv import batched_step
    from specmesh.engine.pool import new_pool

    pool = new_pool(tiny, 2048)
    long_prompt = [(i * 7) % 90 + 1 for i in range(row_attn.MAX_ROWS + 10)]
    decoding = _prefilled(tiny, pool, [3, 4, 5])
    fresh = pool.allocate(len(long_prompt) + 4)
    plans, taken = row_attn.plan([decoding, fresh], [1, len(long_prompt)], [None, None])
    assert taken == [True, False] and plans[0].index.tolist() == [0]
    both = batched_step(tiny, [decoding, fresh], [[6], long_prompt], logits_rows=[None, [len(long_prompt) - 1]])
    alone = pool.allocate(len(long_prompt) + 4)
    ref = batched_step(tiny, [alone], [long_prompt], logits_rows=[[len(long_prompt) - 1]])[0]
    assert torch.allclose(both[1].logits, ref.logits, atol=1e-5)
    assert torch.equal(fresh.keys(1, len(long_prompt)), alone.keys(1, len(long_prompt)))
    assert torch.equal(both[0].logits[0], _steps(tiny, _prefilled(tiny, pool, [3, 4, 5]), [6])[0])
