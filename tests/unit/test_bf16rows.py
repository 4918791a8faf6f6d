"""The bf16 rows kernel (csrc/bf16_rows.cpp, specmesh/engine/bf16rows.py): its sums against a
float reference, row-invariance (batched rows bitwise its one-row calls), and where the engine
runs it: default-mode steps of 2+ rows (a verify's, several sequences' decode rows); a lone row
(AR alone), a prompt's prefill and deterministic steps keep oneDNN's arithmetic, bitwise the plain
model's."""

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
    y = ext.bf16_rows(x, wp, bias)  # [13, 96] bf16
    ref = x.float() @ w.float().T + (0 if bias is None else bias)
    assert y.dtype == torch.bfloat16 and y.shape == (13, 96)
    assert torch.allclose(y.float(), ref, rtol=1e-2, atol=1e-2)
    ones = torch.cat([ext.bf16_rows(x[i:i + 1], wp, bias) for i in range(13)])
    assert torch.equal(ones, y)  # row-invariant: 13 rows (two groups) = 13 one-row calls
    assert torch.equal(ext.bf16_rows(x[:5], wp, bias), y[:5])


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
    """(plain, with the kernel forced on) models of the same weights; counts the kernel's calls."""
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
    real = bf16rows.call
    bf16rows.call = lambda mod, x2: calls.append(x2.shape[0]) or real(mod, x2)
    yield plain, model, calls
    bf16rows.call = real


def test_only_a_batched_steps_rows_take_the_kernel(forced, prefilled):
    plain, model, calls = forced
    prompt = [(7 * i + 3) % 2048 for i in range(60)]
    kvs = [prefilled(m, prompt) for m in (plain, model)]
    assert torch.equal(kvs[0].keys(0, 60), kvs[1].keys(0, 60)) and not calls  # a prefill: oneDNN / F.linear
    one = [batched_step(m, [kv], [[5]])[0].logits for m, kv in zip((plain, model), kvs)]
    assert torch.equal(one[0], one[1]) and not calls  # a lone row (AR): oneDNN's, bitwise the plain model's
    twice = prefilled(model, prompt[:30])
    calls.clear()
    batched_step(model, [kvs[1], twice], [[5], [9]])
    assert calls and set(calls) == {2}  # two sequences' decode rows (AR at concurrency 2): the kernel
    calls.clear()
    five = [batched_step(m, [kv], [[5, 6, 7, 8, 9]])[0].logits for m, kv in zip((plain, model), kvs)]
    assert calls and set(calls) == {5}  # a verify's 5 rows: the kernel (every decoder linear)
    assert torch.allclose(five[0], five[1], atol=0.15)  # another summation order, same function


def test_deterministic_steps_never_take_it(forced, prefilled, one_token_steps):
    _, model, calls = forced
    rowexact.install(model)
    prompt, drafts = [3, 9, 4, 17, 8, 100, 2], [5, 6, 7, 1000, 12, 13]
    kv = prefilled(model, prompt)
    calls.clear()
    exact = batched_step(model, [kv], [drafts], row_exact=True)[0].logits
    assert not calls
    assert torch.equal(exact, one_token_steps(model, prompt, drafts))


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
    assert report["used"] == all(k < o for o, k in zip(report["onednn_ms"], report["kernel_ms"]))
    assert (bf16rows.packed_bytes(auto) > 0) == report["used"]


def test_the_probe_alternates_the_two_paths_passes():
    """oneDNN's and the kernel's passes interleave (a slow spell of a shared VM weighs on both)."""
    order = []

    class Ext:
        @staticmethod
        def bf16_rows(x, wp, bias):
            order.append("k")

    mods = [torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16) for _ in range(2)]
    for m in mods:
        m._specmesh_onednn = m._specmesh_bf16rows = None
    onednn_ms, kernel_ms = bf16rows._probe(mods, Ext, lambda x, wp, bias: order.append("o"))
    assert len(onednn_ms) == len(kernel_ms) == len(bf16rows.PROBE_ROWS)
    passes = "".join(order[::len(mods)])  # one letter per pass over the linears
    rounds = bf16rows.PROBE_REPEATS + 1
    assert passes == ("okko" * rounds)[:2 * rounds] * len(bf16rows.PROBE_ROWS)
