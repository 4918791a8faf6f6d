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


def _call(q, k, v, rows, scale, grouped=True):
    """rows: per query row (start, length, extra slots) -> the kernel's [T, H, D] (grouped: its
    AVX-512 path where built, else the AVX2 one)."""
    off = [0]
    for _, _, extra in rows:
        off.append(off[-1] + len(extra))
    longs = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
    return ext.row_attention(q, k, v, longs([r[0] for r in rows]), longs([r[1] for r in rows]), longs(off),
                             longs([s for r in rows for s in r[2]]), scale, grouped=grouped)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,d", [(9, 3, 64), (12, 2, 128), (4, 4, 32), (16, 2, 96)])
def test_a_sequence_s_rows_together_are_bitwise_each_row_alone(dtype, heads, kv_heads, d):
    """The AVX-512 path (grouped, where built) runs a sequence's rows together: chains, a tree whose
    rows read their paths, rows sharing no slot, groups longer than GROUP_ROWS (16), lone rows; every
    row's bits are the AVX2 path's (grouped=False, one row and head at a time)."""
    gen = torch.Generator().manual_seed(heads + d)
    k = torch.randn(kv_heads, 2600, d, generator=gen).to(dtype)
    v = (torch.randn(kv_heads, 2600, d, generator=gen) * 4).to(dtype)
    chain = [(100, 2201 + j, []) for j in range(5)]  # a 5-row verify over a long cache
    tree = [(2400, 37, [2437 + p for p in path]) for path in ([0], [0, 1], [0, 2], [0, 1, 3], [0, 2, 4], [0, 2, 5])]
    rows = (chain + tree + [(0, 1, []), (0, 3, []), (50, 9, [1, 2]), (10, 0, [699, 700])]
            + [(800, 20 + j, []) for j in range(19)] + [(1000, 7, [])])
    q = (torch.randn(len(rows), heads, d, generator=gen) * 2).to(dtype)
    grouped = _call(q, k, v, rows, d**-0.5)
    assert torch.equal(grouped, _call(q, k, v, rows, d**-0.5, grouped=False))
    for t in (0, 4, 5, 10, 20, 33):
        assert torch.equal(_call(q[t : t + 1], k, v, [rows[t]], d**-0.5)[0], grouped[t]), t


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


def test_bf16_batched_steps_take_the_kernel_but_never_the_target_alone_s_own_steps():
    """bf16 outside the deterministic modes (enable_bf16): a step of several rows takes the kernel
    (one call per layer instead of one SDPA call per sequence), but a lone one-token step and a
    prefill keep SDPA, so the target alone's decode is untouched; mode 1 (HF's one-row kernels)
    never takes it, and enable_bf16(model, False) switches it off."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specmesh.engine.kv import batched_step
    from specmesh.engine.pool import new_pool

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    pool = new_pool(model, 1024)
    prompts = [[5, 9, 2, 40, 7, 1], [3, 8, 8, 20]]
    kvs = [_prefilled(model, pool, p) for p in prompts]
    calls, saved = [], cpu_gemm._EXT
    real = ext.row_attention

    def step(kv_list, inputs):
        calls.clear()
        return batched_step(model, kv_list, inputs)

    try:
        row_attn.enable_bf16(model)
        cpu_gemm._EXT = type("Spy", (), {"row_attention": lambda self, *a: calls.append(1) or real(*a),
                                         "__getattr__": lambda self, name: getattr(saved, name)})()
        assert row_attn.usable(model, kvs, 0, [1, 1]) and row_attn.usable(model, kvs[:1], 0, [5])
        assert not row_attn.usable(model, kvs[:1], 0, [1]) and not row_attn.usable(model, kvs, 1, [1, 1])
        assert row_attn.usable(model, kvs[:1], 2, [1])
        fresh = pool.allocate(16)
        assert row_attn.plan([kvs[0], fresh], [1, 6], [None, None])[1] == [True, False]  # the prefill: SDPA
        many = row_attn.BF16_MAX_ROWS + 1  # one SDPA call over many rows is cheaper
        assert row_attn.plan(kvs, [row_attn.BF16_MAX_ROWS, many], [None, None])[1] == [True, False]
        assert row_attn.plan(kvs, [many, 1], [None, None], exact=True)[1] == [True, True]
        lone = step(kvs[:1], [[4]])[0].logits  # the target alone's step: torch SDPA, no kernel call
        assert not calls
        both = step(kvs, [[4], [6]])  # two sequences: the kernel, one call per layer
        assert len(calls) == cfg.num_hidden_layers
        assert torch.allclose(both[0].logits, lone, atol=0.25)  # bf16 rounding apart, not bitwise
        row_attn.enable_bf16(model, False)
        step(kvs, [[4], [6]])
        assert not calls
    finally:
        cpu_gemm._EXT = saved
        row_attn.enable_bf16(model, False)


def test_bf16_auto_takes_the_kernel_only_where_the_probe_times_it_faster(monkeypatch):
    """cpu_kernel auto (enable_bf16(model, "auto")): the kernel is allowed exactly where
    bf16_gain (SDPA's time / the kernel's) is at least 1, and the gain is kept for reports; a
    float32 model is never allowed it, whatever the gain; the real probe returns a positive speed ratio."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    measured = row_attn.bf16_gain(model)
    assert measured > 0
    assert row_attn.bf16_gain(model, 9) > 0
    try:
        for gain, allowed in ((0.7, False), (1.0, True), (1.6, True)):
            monkeypatch.setattr(row_attn, "bf16_gain", lambda m, rows=5, g=gain: g)
            assert row_attn.enable_bf16(model, "auto") is allowed
            assert model._specmesh_row_attn_gain == gain
        # the row limit: raised while the kernel also wins at each of WIDER_ROWS, in order
        (_, sixteen), (_, widest) = row_attn.WIDER_ROWS
        for by_rows, limit in (({9: 0.9, 17: 1.2}, row_attn.BF16_MAX_ROWS), ({9: 1.1, 17: 0.8}, sixteen),
                               ({9: 1.1, 17: 1.3}, widest)):
            monkeypatch.setattr(row_attn, "bf16_gain", lambda m, rows=5, g=by_rows: g.get(rows, 1.4))
            assert row_attn.enable_bf16(model, "auto") and row_attn.bf16_max_rows(model) == limit
            assert row_attn.takes(limit, None, cached=4, bf16=True, bf16_max=limit)
            assert not row_attn.takes(limit + 1, None, cached=4, bf16=True, bf16_max=limit)
        assert row_attn.enable_bf16(model, True)  # forced: no probe
        assert row_attn.bf16_max_rows(model) == row_attn.BF16_MAX_ROWS
        assert not row_attn.enable_bf16(LlamaForCausalLM(cfg).eval(), "auto")  # float32
    finally:
        row_attn.enable_bf16(model, False)
