"""The lean decoder forward (specmesh/engine/lean.py): bitwise the HF-module path of the same
engine step (Llama and Qwen2 shapes, q/k/v biases, chains, trees, packed batches, deterministic or
not), the stacked weights are views (no second copy), and models it does not fit keep HF's path."""

from __future__ import annotations

import pytest
import torch

from specmesh.core.tree import tree_layout
from specmesh.engine import cpu_gemm, lean, rowexact
from specmesh.engine.kv import batched_step
from specmesh.engine.pool import new_pool

pytestmark = pytest.mark.skipif(cpu_gemm.load() is None, reason=f"kernel not usable: {cpu_gemm.unusable_reason()}")


def _model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    shape = dict(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    model = (LlamaForCausalLM(LlamaConfig(**shape)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**shape)))
    model = model.float().eval()
    assert cpu_gemm.install(model)
    return rowexact.install(model)  # as the target worker sets it up


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return _model(request.param)


def _run(model, use_lean: bool, row_exact: bool):
    """Prefill three sequences, then one step with a 5-token chain, a one-token row and a tree."""
    model._specmesh_lean = None if use_lean else False
    pool = new_pool(model, 2048)
    prompts = [[5, 9, 2, 40, 7], [3] * 30, [11, 12, 13]]
    kvs = []
    for p in prompts:
        kv = pool.allocate(len(p) + 20)
        batched_step(model, [kv], [p], logits_rows=[[len(p) - 1]], row_exact=row_exact)
        kv.commit(len(p))
        kvs.append(kv)
    mask, depth = tree_layout([-1, -1, 0, 0, 2])
    outs = batched_step(model, kvs, [[4, 8, 15, 16, 23], [42], [1, 2, 3, 4, 5, 6]], new_masks=[None, None, mask],
                        depths=[None, None, depth], row_exact=row_exact)
    return [o.logits for o in outs], [kv.keys(1, kv.length + n).clone() for kv, n in zip(kvs, (5, 1, 6))]


@pytest.mark.parametrize("row_exact", [True, False])
def test_lean_steps_are_bitwise_the_hf_module_steps(model, row_exact):
    slow_logits, slow_keys = _run(model, False, row_exact)
    fast_logits, fast_keys = _run(model, True, row_exact)
    assert model._specmesh_lean is True
    for a, b in zip(slow_logits + slow_keys, fast_logits + fast_keys):
        assert torch.equal(a, b)


def test_stacked_weights_are_views_and_steps_with_hidden_states_take_lean_bitwise(model):
    assert lean.prepare(model)
    layer = model.model.layers[0]
    stacked = layer._specmesh_qkv[0]
    assert layer.self_attn.k_proj._specmesh_packed.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    assert (layer._specmesh_qkv[1] is not None) == (model.config.model_type == "qwen2")  # Qwen2: q/k/v biases
    calls = []
    real = lean.forward
    lean.forward = lambda *a: calls.append(1) or real(*a)
    every = tuple(range(model.config.num_hidden_layers + 1))  # embeddings, each layer, the last normed
    try:
        got = {}
        for use_lean in (False, True):  # a block drafter's feature rounds: HF's hidden_states, bitwise
            model._specmesh_lean = None if use_lean else False
            kv = new_pool(model, 64).allocate(16)
            pre = batched_step(model, [kv], [[1, 2, 3]], hidden_layers=every)[0]
            kv.commit(3)
            step = batched_step(model, [kv], [[4, 5]], hidden_layers=every, row_exact=True)[0]
            got[use_lean] = list(pre.hidden_states) + list(step.hidden_states) + [pre.logits, step.logits]
        assert len(calls) == 2  # the lean forward took both steps, features and all
        assert all(torch.equal(a, b) for a, b in zip(got[False], got[True]))
    finally:
        lean.forward = real


def test_models_it_does_not_fit_keep_hf_path():
    from transformers import LlamaConfig, LlamaForCausalLM

    odd = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=200, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2)).float().eval()
    assert cpu_gemm.install(odd) and not lean.prepare(odd)  # 200 MLP rows: not whole 16-row panels
    plain = _model("llama")
    plain._specmesh_cpu_gemm = False
    assert not lean.prepare(plain)
