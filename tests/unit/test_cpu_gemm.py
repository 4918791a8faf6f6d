"""The packed CPU verify kernel (specmesh/engine/cpu_gemm.py): correct against F.linear, bitwise
row-invariant at every row count and tiling, used only inside engine steps, probed invariant."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specmesh.engine import cpu_gemm, rowexact

ext = cpu_gemm.load()
needs_kernel = pytest.mark.skipif(ext is None, reason=f"kernel not usable here: {cpu_gemm.unusable_reason()}")


def test_unusable_reasons_are_named():
    assert cpu_gemm.unusable_reason("flags\t: fpu sse sse2\n") in ("the CPU lacks AVX2/FMA", "not x86-64 (aarch64)",
                                                                    f"not x86-64 ({__import__('platform').machine()})")


def test_avx512_tiles_are_built_only_where_the_cpu_has_them():
    assert "-mavx512f" in cpu_gemm.build_flags("flags\t: fpu avx2 fma avx512f avx512bw\n")
    assert cpu_gemm.build_flags("flags\t: fpu avx2 fma\n") == ["-O3", "-mavx2", "-mfma"]


@needs_kernel
@pytest.mark.parametrize("n_out,n_in", [(40, 24), (16, 8), (33, 17), (5, 64)])
def test_matches_f_linear_and_every_row_count_is_bitwise_the_one_row_calls(n_out, n_in):
    gen = torch.Generator().manual_seed(n_out * 7 + n_in)
    w, b = torch.randn(n_out, n_in, generator=gen), torch.randn(n_out, generator=gen)
    wp = ext.pack(w)
    rows = 27  # AVX2: ceil(m / 6) row groups of equal size (+-1); AVX-512: blocks of 12 and a 3-row tail
    x = torch.randn(rows, n_in, generator=gen) * torch.exp2(torch.randint(-8, 9, (rows, n_in), generator=gen).float())
    singles = torch.cat([ext.linear(x[i : i + 1], wp, b, n_out) for i in range(rows)])
    assert torch.allclose(singles, F.linear(x, w, b), rtol=1e-4, atol=1e-3 * float(x.abs().max()))
    for m in range(1, rows + 1):  # AVX2: groups of 1-2 rows use 32-column tiles, 3-6 16-column ones
        for start in (0, rows - m):
            assert torch.equal(ext.linear(x[start : start + m], wp, b, n_out), singles[start : start + m]), (m, start)
    assert ext.linear(x[:3].view(1, 3, n_in), wp, None, n_out).shape == (1, 3, n_out)


@needs_kernel
@pytest.mark.parametrize("n_out,n_in", [(40, 24), (33, 17), (96, 64)])
def test_a_bf16_exact_weight_packs_in_bf16_and_gives_the_float32_panels_bits(n_out, n_in):
    """A float32 weight holding only bf16 values (a bf16 checkpoint loaded as float32) is packed in
    bf16 (AVX2 and AVX-512 builds alike): half the bytes, every output bit the float32 panels', at
    every row count and offset; any other weight (or narrow=False) keeps float32 panels."""
    gen = torch.Generator().manual_seed(n_out + n_in)
    w = (torch.randn(n_out, n_in, generator=gen) * torch.exp2(torch.randint(-12, 13, (n_out, n_in), generator=gen)
                                                              .float())).to(torch.bfloat16).float()
    b = torch.randn(n_out, generator=gen)
    wide, narrow = ext.pack(w, narrow=False), ext.pack(w)
    assert wide.dtype == torch.float32 and ext.pack(w + 2 ** -20).dtype == torch.float32
    assert narrow.dtype == torch.bfloat16
    assert narrow.shape == wide.shape and narrow.nbytes == wide.nbytes // 2
    rows = 27
    x = torch.randn(rows, n_in, generator=gen) * torch.exp2(torch.randint(-8, 9, (rows, n_in), generator=gen).float())
    for m in range(1, rows + 1):
        for start in (0, rows - m):
            assert torch.equal(ext.linear(x[start:start + m], narrow, b, n_out),
                               ext.linear(x[start:start + m], wide, b, n_out)), (m, start)


@needs_kernel
def test_linears_take_the_kernel_only_inside_a_step_and_probe_invariant():
    from transformers import LlamaConfig, LlamaForCausalLM

    from specmesh.engine.kv import batched_step
    from specmesh.engine.pool import new_sequence_kv

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).float().eval()
    ids = torch.tensor([[3, 9, 4, 17, 8]])
    with torch.inference_mode():
        plain = model(ids).logits[0]
    assert cpu_gemm.install(model) and cpu_gemm.packed_bytes(model) > 0
    calls = []
    real = ext.linear
    cpu_gemm._EXT = type("Spy", (), {"linear": staticmethod(lambda *a: calls.append(1) or real(*a)),
                                     "__getattr__": lambda self, name: getattr(ext, name)})()
    try:
        with torch.inference_mode():
            assert torch.equal(model(ids).logits[0], plain)  # HF's own forward: untouched
        assert not calls
        kv = new_sequence_kv(model, 8)
        out = batched_step(model, [kv], [ids[0].tolist()])[0]
        assert calls and torch.allclose(out.logits, plain, atol=1e-4)
    finally:
        cpu_gemm._EXT = ext
    rowexact.install(model)
    probed = rowexact.probed(model)  # every count at its probe limit: the kernel is row-invariant
    assert probed.pop("lm_head float32") == rowexact.PROBE_HEAD_ROWS and set(probed.values()) == {rowexact.PROBE_ROWS}
    assert rowexact.cheap(model)


@needs_kernel
def test_a_single_packed_linear_applies_at_any_row_count_outside_steps():
    """pack_linear / apply (the block drafter's shared LM head): the kernel outside engine steps,
    F.linear's result within rounding, each row bitwise its one-row call; an unpacked or bf16
    module runs its own forward."""
    torch.manual_seed(1)
    head = torch.nn.Linear(24, 300, bias=False)
    x = torch.randn(7, 24)
    assert not cpu_gemm.in_step() and cpu_gemm.apply(head, x).equal(head(x))  # not packed yet
    assert cpu_gemm.pack_linear(head) and cpu_gemm.pack_linear(head)  # idempotent
    y = cpu_gemm.apply(head, x)
    assert torch.allclose(y, head(x), rtol=1e-4, atol=1e-4)
    assert torch.equal(torch.cat([cpu_gemm.apply(head, x[i:i + 1]) for i in range(7)]), y)
    half = torch.nn.Linear(24, 300, bias=False).to(torch.bfloat16)
    assert not cpu_gemm.pack_linear(half) and cpu_gemm.apply(half, x.bfloat16()).equal(half(x.bfloat16()))
