"""kv._attend's loop in C++ (csrc/lean_layer.cpp's pool_attend): bitwise the Python loop for every
kind of sequence a step holds (a prefill with is_causal, a masked chain, a one-token row by HF's
call, folded or on the exact kernel, a masked tree, deterministic rows of a chain and of a tree), bf16 and float32, and the KV it
writes is the loop's."""

from __future__ import annotations

import pytest
import torch

from specmesh.core.tree import tree_layout
from specmesh.engine import attention, cpu_gemm, exactrow, kv as kvmod, rowexact
from specmesh.engine.kv import batched_step
from specmesh.engine.pool import new_pool

pytestmark = pytest.mark.skipif(cpu_gemm.load() is None, reason=f"kernel not usable: {cpu_gemm.unusable_reason()}")


def _model(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    model = model.to(dtype).eval()
    model._specmesh_cpu_gemm = False  # HF's linears and torch's SDPA: every sequence takes pool_attend
    return rowexact.install(model)


def _run(model, native: bool, row_exact: bool, monkeypatch, taken: list):
    monkeypatch.setattr(kvmod, "NATIVE", native)
    pool = new_pool(model, 2048)
    kvs, got = [], []
    for p in ([5, 9, 2, 40, 7], [3] * 30, [11, 12, 13]):
        kv = pool.allocate(len(p) + 20)
        got.append(batched_step(model, [kv], [p], logits_rows=[[len(p) - 1]], row_exact=row_exact)[0].logits)
        kv.commit(len(p))
        kvs.append(kv)
    mask, depth = tree_layout([-1, -1, 0, 0, 2])
    outs = batched_step(model, kvs, [[4, 8, 15, 16, 23], [42], [1, 2, 3, 4, 5, 6]], new_masks=[None, None, mask],
                        depths=[None, None, depth], row_exact=row_exact)
    got += [o.logits for o in outs] + [batched_step(model, kvs[1:2], [[7]], row_exact=row_exact)[0].logits]
    # the slots the steps wrote (past them the pool holds whatever its memory held)
    return got + [torch.cat([kv.keys(1, kv.length + n), kv.values(0, kv.length + n)]).clone()
                  for kv, n in zip(kvs, (5, 1, 6))]


@pytest.mark.parametrize("one", [0, 1, 2], ids=["hf-call", "folded", "exact"])
@pytest.mark.parametrize("row_exact", [False, True], ids=["batched", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pool_attend_is_bitwise_the_python_loop(dtype, row_exact, one, monkeypatch):
    if one == 2 and (dtype != torch.bfloat16 or exactrow._ext() is None):
        pytest.skip("the exact kernel takes bf16 rows, where built (AVX-512)")
    model = _model(dtype)
    monkeypatch.setattr(attention, "one_token_mode", lambda *a: one)
    monkeypatch.setattr(kvmod, "one_token_mode", lambda *a: one)
    taken: list = []
    real = kvmod.native_geometry
    monkeypatch.setattr(kvmod, "native_geometry", lambda *a: taken.append(real(*a)) or taken[-1])
    slow = _run(model, False, row_exact, monkeypatch, taken)
    assert all(t is None for t in taken)
    fast = _run(model, True, row_exact, monkeypatch, taken)
    assert sum(t is not None for t in taken) == 5  # every step of the second run took the C++ loop
    assert len(slow) == len(fast) == 10
    for a, b in zip(slow, fast):
        assert torch.equal(a, b)
