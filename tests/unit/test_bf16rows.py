"""The bf16 rows kernel (csrc/bf16_rows.cpp, specmesh/engine/bf16rows.py): its sums against a
float reference, row-invariance (batched rows bitwise its one-row calls), its K blocks (kc), the
probe that finds the block making its rows bitwise oneDNN's one-row calls (F.linear's), and where
the engine runs it: default-mode steps of 2+ rows; where exact, also a lone row (AR: still bitwise
the plain model's) and a deterministic step's rows (still bitwise the one-token steps); a
prompt's prefill never."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine import bf16rows, cpu_gemm, onednn, rowexact
from specmesh.engine.kv import batched_step


def _ext():
    ext = cpu_gemm.load()
    return ext if ext is not None and ext.bf16_rows_built() else None


pytestmark = pytest.mark.skipif(_ext() is None or not onednn.available(),
                                reason="no AVX512-BF16 build of the CPU kernels (or no oneDNN bf16) here")


@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_sums_in_float32_and_its_rows_are_its_one_row_calls(with_bias):
    ext = _ext()
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    x = torch.randn(13, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen) if with_bias else None
    wp = ext.bf16_pack(w)
    assert tuple(wp.shape) == (3, 32, 64)
    # packing is per 32-column block: two members' copies stacked are the stacked weight's packing
    assert torch.equal(torch.cat([ext.bf16_pack(w[:64]), ext.bf16_pack(w[64:])]), wp)
    y = ext.bf16_rows(x, wp, bias, 0)  # [13, 96] bf16
    ref = x.float() @ w.float().T + (0 if bias is None else bias)
    assert y.dtype == torch.bfloat16 and y.shape == (13, 96)
    assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2)
    ones = torch.cat([ext.bf16_rows(x[i:i + 1], wp, bias) for i in range(13)])  # kc defaults to 0
    assert torch.equal(ones, y)  # row-invariant: 13 rows (two groups) = 13 one-row calls
    assert torch.equal(ext.bf16_rows(x[:5], wp, bias), y[:5])
    chunked = ext.bf16_rows(x, wp, bias, 8)  # K blocks of 16: row-invariant too, close to one chain
    assert torch.equal(torch.cat([ext.bf16_rows(x[i:i + 1], wp, bias, 8) for i in range(13)]), chunked)
    assert torch.allclose(chunked.float(), ref, rtol=1e-2, atol=1e-2)
    assert torch.equal(ext.bf16_rows(x, wp, bias, 32), y)  # one block of all 32 k-pairs: the one chain


def test_each_k_block_sums_from_zero_and_the_blocks_add_in_order():
    """x . w over k-pairs (1, 2^24, 1, -2^24) (odd lanes 0): one float32 chain rounds 1 + 2^24 to
    2^24 and ends at 0; blocks of 2 pairs sum (2^24) + (1 - 2^24) = 1; blocks of 1 pair chain again."""
    ext = _ext()
    x = torch.tensor([[1.0, 0.0] * 4], dtype=torch.bfloat16)  # [1, 8]
    w = torch.tensor([[1.0, 0.0, 2.0 ** 24, 0.0, 1.0, 0.0, -(2.0 ** 24), 0.0]] * 32, dtype=torch.bfloat16)  # [32, 8]
    wp = ext.bf16_pack(w)
    assert torch.equal(ext.bf16_rows(x, wp, None, 0), torch.zeros(1, 32, dtype=torch.bfloat16))
    assert torch.equal(ext.bf16_rows(x, wp, None, 2), torch.ones(1, 32, dtype=torch.bfloat16))
    assert torch.equal(ext.bf16_rows(x, wp, None, 1), torch.zeros(1, 32, dtype=torch.bfloat16))
    assert torch.equal(ext.bf16_rows(x, wp, None, 3), torch.zeros(1, 32, dtype=torch.bfloat16))  # (1 + 2^24 + 1) - 2^24


def test_the_exact_block_found_makes_rows_bitwise_one_row_f_linear_calls():
    """exact_chunk's block (where this CPU's oneDNN has one among the candidates) on draws the probe
    never saw, wide-range and normal: every row of 1-13-row calls = F.linear's one-row call."""
    ext = _ext()
    mods = [torch.nn.Linear(k, n, bias=False).to(torch.bfloat16) for n, k in ((64, 1536), (96, 576), (64, 1024))]
    kc = bf16rows.exact_chunk(mods, ext, onednn.run, onednn.pack)
    if kc is None:
        pytest.skip("no candidate block makes the kernel oneDNN's one-row call on this CPU")
    assert kc in bf16rows.CHUNKS
    gen = torch.Generator().manual_seed(77)
    for m in mods:
        for scale in (1.0, 2.0 ** 8):
            w = (torch.randn(m.weight.shape, generator=gen) * torch.exp2(torch.randint(-8, 9, m.weight.shape, generator=gen))).bfloat16()
            x = (torch.randn(13, m.in_features, generator=gen) * scale).bfloat16()
            one = torch.cat([torch.nn.functional.linear(x[i:i + 1], w) for i in range(13)])
            wp = ext.bf16_pack(w)
            for rows in (1, 4, 13):
                assert torch.equal(ext.bf16_rows(x[:rows], wp, None, kc), one[:rows])


def test_pack_refuses_shapes_it_cannot_tile():
    ext = _ext()
    with pytest.raises(RuntimeError):
        ext.bf16_pack(torch.zeros(48, 64, dtype=torch.bfloat16))  # 48 columns: not whole panel pairs
    with pytest.raises(RuntimeError):
        ext.bf16_pack(torch.zeros(64, 63, dtype=torch.bfloat16))  # odd K


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).to(torch.bfloat16).eval()


@pytest.fixture()
def forced():
    """(plain, with the kernel forced on) models of the same weights; records the calls that take
    the kernel: (rows, deterministic)."""
    bf16rows.configure(True)
    try:
        plain, model = _model(), _model()
        onednn.install(plain)
        cpu_gemm.install(model)
    finally:
        bf16rows.configure("auto")
    if not any(v["packed"] for v in model._specmesh_onednn_report.values()):
        pytest.skip("oneDNN prepacked nothing on this CPU")
    assert model._specmesh_bf16rows_report["used"] and bf16rows.packed_bytes(model) > 0
    calls = []
    real = bf16rows.route

    def route(mod, rows, prefill, det=False):
        r = real(mod, rows, prefill, det)
        if r is not None:
            calls.append((rows, det))
        return r

    bf16rows.route = route
    yield plain, model, calls
    bf16rows.route = real


def test_where_a_step_takes_the_kernel(forced, prefilled, one_token_steps):
    plain, model, calls = forced
    exact = model._specmesh_bf16rows_report["exact"]
    prompt = [(7 * i + 3) % 2048 for i in range(60)]
    kvs = [prefilled(m, prompt) for m in (plain, model)]
    assert torch.equal(kvs[0].keys(0, 60), kvs[1].keys(0, 60)) and not calls  # a prefill: oneDNN / F.linear
    one = [batched_step(m, [kv], [[5]])[0].logits for m, kv in zip((plain, model), kvs)]
    assert torch.equal(one[0], one[1])  # a lone row (AR): bitwise the plain model's, kernel or not
    assert bool(calls) == exact and set(calls) <= {(1, False)}  # forced on and exact: the kernel
    twice = prefilled(model, prompt[:30])
    calls.clear()
    batched_step(model, [kvs[1], twice], [[5], [9]])
    assert calls and set(calls) == {(2, False)}  # two sequences' decode rows (AR at concurrency 2): the kernel
    calls.clear()
    five = [batched_step(m, [kv], [[5, 6, 7, 8, 9]])[0].logits for m, kv in zip((plain, model), kvs)]
    assert calls and set(calls) == {(5, False)}  # a verify's 5 rows: the kernel (every decoder linear)
    assert torch.allclose(five[0], five[1], atol=0.15)  # another summation order (or the same), same function
    steps = [one_token_steps(m, prompt, [5, 6, 7, 8]) for m in (plain, model)]
    assert torch.equal(steps[0], steps[1])  # the AR of 4 tokens: HF's one-row arithmetic throughout


def test_the_head_serves_batched_rows_where_exact_bitwise_its_one_row_calls(forced):
    """Exact, the LM head's copy serves a verify's rows too (forced on here; auto: where its 5- and
    9-row calls beat oneDNN's), each row bitwise oneDNN's one-row call; a prefill never."""
    _, model, _ = forced
    if not model._specmesh_bf16rows_report["exact"]:
        pytest.skip("no K block makes the kernel's rows oneDNN's one-row calls on this CPU")
    head, report = model.get_output_embeddings(), model._specmesh_bf16rows_report["head"]
    assert report["lone"] and report["batched"]
    assert len(report["onednn_ms"]) == len(report["kernel_ms"]) == len(bf16rows.PROBE_ROWS)
    assert bf16rows.route(head, 5, False) is not None and bf16rows.route(head, 40, False, det=True) is not None
    assert bf16rows.route(head, 5, True) is None  # a prompt's prefill: oneDNN's call
    limit = head._specmesh_bf16rows_use.max_rows  # past the probed limit: oneDNN's batched call
    assert bf16rows.route(head, limit, False) is not None and bf16rows.route(head, limit + 1, False) is None
    x = torch.randn(9, head.in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    rows = bf16rows.call(head, x, False)  # [9, V]
    ones = torch.cat([onednn.run(x[i:i + 1], head._specmesh_onednn, None) for i in range(9)])
    assert torch.equal(rows, ones)


def test_deterministic_steps_take_it_only_where_exact(forced, prefilled, one_token_steps):
    _, model, calls = forced
    rowexact.install(model)
    prompt, drafts = [3, 9, 4, 17, 8, 100, 2], [5, 6, 7, 1000, 12, 13]
    kv = prefilled(model, prompt)
    calls.clear()
    exact = batched_step(model, [kv], [drafts], row_exact=True)[0].logits
    assert bool(calls) == model._specmesh_bf16rows_report["exact"] and all(det for _, det in calls if _ > 1)
    assert torch.equal(exact, one_token_steps(model, prompt, drafts))
    shown = rowexact.probed(model, 1)  # logs and reports name the kernel where it serves ...
    assert any("exact rows kernel" in k for k in shown) == model._specmesh_bf16rows_report["exact"]
    bare = rowexact.probed(model, 1, kernel=False)  # ... but batch_invariant auto weighs oneDNN's counts only
    assert not any("exact rows kernel" in k for k in bare)
    assert rowexact.cheap(model, 1) == (min(bare.values()) >= rowexact.CHEAP_ROWS)


def test_false_installs_nothing_and_auto_reports_its_probe():
    bf16rows.configure(False)
    try:
        off = _model()
        cpu_gemm.install(off)
    finally:
        bf16rows.configure("auto")
    assert off._specmesh_bf16rows_report == {"used": False, "why": "bf16_rows false"}
    assert bf16rows.packed_bytes(off) == 0
    auto = _model()
    cpu_gemm.install(auto)
    report = auto._specmesh_bf16rows_report
    assert len(report["onednn_ms"]) == len(report["kernel_ms"]) == len(bf16rows.PROBE_ROWS)
    faster = [k < o for o, k in zip(report["onednn_ms"], report["kernel_ms"])]
    assert report["used"] == (report["exact"] or all(faster[1:3]))  # exact: batched rows whatever the timing
    assert report["lone"] == (report["exact"] and faster[0])
    assert report["max_rows"] == (bf16rows.WIDE_MAX_ROWS if faster[3] else bf16rows.MAX_ROWS)  # wide batches
    assert (bf16rows.packed_bytes(auto) > 0) == report["used"]
    if "head" in report:  # lone rows where its one-row call is faster, batched where its 5- and 9-row calls are
        head = report["head"]
        pairs = list(zip(head["onednn_ms"], head["kernel_ms"]))
        assert head["lone"] == (pairs[0][1] < pairs[0][0]) and head["batched"] == all(k < o for o, k in pairs[1:3])
        assert head["max_rows"] == (bf16rows.WIDE_MAX_ROWS if pairs[3][1] < pairs[3][0] else bf16rows.MAX_ROWS)


def test_the_probe_alternates_the_two_paths_passes():
    """oneDNN's and the kernel's passes interleave (a slow spell of a shared VM weighs on both)."""
    order = []

    class Ext:
        @staticmethod
        def bf16_rows(x, wp, bias, kc):
            order.append("k")

    mods = [torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16) for _ in range(2)]
    for m in mods:
        m._specmesh_onednn = m._specmesh_bf16rows = None
    onednn_ms, kernel_ms = bf16rows._probe(mods, Ext, lambda x, wp, bias: order.append("o"), 0)
    assert len(onednn_ms) == len(kernel_ms) == len(bf16rows.PROBE_ROWS)
    passes = "".join(order[::len(mods)])  # one letter per pass over the linears
    rounds = bf16rows.PROBE_REPEATS + 1
    assert passes == ("okko" * rounds)[:2 * rounds] * len(bf16rows.PROBE_ROWS)
