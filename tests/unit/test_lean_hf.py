"""The lean forward over routed linears (specmesh/engine/lean_hf.py): bitwise the HF-module path of
the same engine step, for the models lean.py does not take (bf16 with oneDNN's prepacked linears
where this CPU has them, float32 without the packed kernel), Llama and Qwen2 shapes, prefills,
chains, trees, packed batches, hidden states, deterministic or not; models it does not fit keep
HF's path."""

from __future__ import annotations

import pytest
import torch

from specmesh.core.tree import tree_layout
from specmesh.engine import cpu_gemm, lean_hf, onednn, onednn_stack, rowexact
from specmesh.engine.kv import batched_step
from specmesh.engine.pool import new_pool


def _model(kind: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    shape = dict(vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256)
    model = (LlamaForCausalLM(LlamaConfig(**shape)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**shape)))
    model = model.to(dtype).eval()
    if dtype == torch.bfloat16:  # as the target worker: oneDNN's prepacked linears where this CPU runs them
        real = onednn.gain
        onednn.gain = lambda w, b: 2.0  # wherever the probe finds them bitwise, not where a timing of
        try:  # these toy shapes happens to favour them (~1.1x here, under 1 on a busy machine)
            cpu_gemm.install(model)
        finally:
            onednn.gain = real
    return rowexact.install(model)


@pytest.fixture(scope="module", params=[("llama", torch.bfloat16), ("qwen2", torch.bfloat16), ("llama", torch.float32)],
                ids=["llama-bf16", "qwen2-bf16", "llama-fp32"])
def model(request):
    return _model(*request.param)


def _run(model, use_lean: bool, row_exact: bool, every: tuple[int, ...] = ()):
    """Prefill three sequences, then one step with a 5-token chain, a one-token row and a tree:
    (logits and hidden states of every step, the new keys of layer 1)."""
    model._specmesh_lean_hf = None if use_lean else False
    pool = new_pool(model, 2048)
    prompts = [[5, 9, 2, 40, 7], [3] * 30, [11, 12, 13]]
    kvs, got = [], []
    for p in prompts:
        kv = pool.allocate(len(p) + 20)
        out = batched_step(model, [kv], [p], logits_rows=[[len(p) - 1]], row_exact=row_exact, hidden_layers=every)[0]
        got += [out.logits, *(out.hidden_states or ())]
        kv.commit(len(p))
        kvs.append(kv)
    mask, depth = tree_layout([-1, -1, 0, 0, 2])
    outs = batched_step(model, kvs, [[4, 8, 15, 16, 23], [42], [1, 2, 3, 4, 5, 6]], new_masks=[None, None, mask],
                        depths=[None, None, depth], row_exact=row_exact, hidden_layers=every)
    got += [t for o in outs for t in (o.logits, *(o.hidden_states or ()))]
    return got + [kv.keys(1, kv.length + n).clone() for kv, n in zip(kvs, (5, 1, 6))]


@pytest.mark.parametrize("cpp", [True, False], ids=["cpp", "python"])
@pytest.mark.parametrize("row_exact", [True, False])
def test_lean_hf_steps_are_bitwise_the_hf_module_steps(model, row_exact, cpp, monkeypatch):
    slow = _run(model, False, row_exact)
    calls, plans = [], []
    real, real_plan = lean_hf.forward, lean_hf._cpp_plan
    monkeypatch.setattr(lean_hf, "forward", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(lean_hf, "_cpp_plan", lambda *a: plans.append(real_plan(*a)) or plans[-1])
    monkeypatch.setattr(lean_hf, "CPP", cpp)
    fast = _run(model, True, row_exact)
    assert model._specmesh_lean_hf is True and len(calls) == 4  # three prefills and the mixed step
    # the C++ halves take every layer whose projections are all prepacked, stacked (csrc/lean_layer.cpp)
    lay = model._specmesh_lean_hf_layers[0]
    takes = cpp and cpu_gemm.load() is not None and lay.qkv is not None and lay.gate_up is not None and \
        onednn.is_own(lay.o) and onednn.is_own(lay.down)
    assert any(p is not None for p in plans) == takes
    assert len(slow) == len(fast)
    for a, b in zip(slow, fast):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_hidden_states_are_hf_output_hidden_states_bitwise(model):
    every = tuple(range(model.config.num_hidden_layers + 1))  # embeddings, each layer, the last normed
    slow, fast = _run(model, False, True, every), _run(model, True, True, every)
    assert len(slow) == len(fast) > 20
    assert all(torch.equal(a, b) for a, b in zip(slow, fast))


def test_a_norm_routed_in_chunks_keeps_its_chunks():
    """A norm the probe found invariant to fewer rows (a GPU's) is run through its routed forward."""
    model = _model("llama", torch.bfloat16)
    norm = model.model.layers[0].post_attention_layernorm
    if not getattr(norm, "_specmesh_routed", False):  # invariant to the probe's limit on this CPU: route it
        import types

        from specmesh.engine import rownorm

        norm.forward = types.MethodType(rownorm.norm_forward, norm)
        norm._specmesh_routed = True
    norm._specmesh_rows = 1
    seen = []
    inner = norm.forward
    norm.forward = lambda x: seen.append(x.shape[0]) or inner(x)
    slow, fast = _run(model, False, True), _run(model, True, True)
    assert all(torch.equal(a, b) for a, b in zip(slow, fast))
    assert 12 in seen  # the mixed step's 12 rows went through the routed norm under lean_hf too


def test_models_it_does_not_fit_keep_hf_path():
    from transformers import GemmaConfig, GemmaForCausalLM

    gemma = rowexact.install(GemmaForCausalLM(GemmaConfig(
        vocab_size=96, hidden_size=128, intermediate_size=192, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32)).eval())
    assert not lean_hf.prepare(gemma)
    kv = new_pool(gemma, 64).allocate(16)
    assert batched_step(gemma, [kv], [[1, 2, 3]])[0].logits.shape == (3, 96)
    plain = _model("llama", torch.float32)
    plain._specmesh_cpu_gemm = True  # lean.py's model (packed kernel): not this forward's
    assert not lean_hf.prepare(plain)


@pytest.mark.skipif(not onednn.available(), reason="torch without oneDNN's prepacked bf16 linears on this CPU")
def test_stacks_replace_the_members_copies_bitwise_and_memory_neutral():
    model = _model("qwen2", torch.bfloat16)  # q/k/v biases
    layer = model.model.layers[0]
    a = layer.self_attn
    x = torch.randn(7, a.q_proj.in_features).to(torch.bfloat16)
    if not onednn_stack.stack_equal([a.q_proj, a.k_proj, a.v_proj]):
        pytest.skip("this CPU's stacked prepacked call is not bitwise its members'")
    before_bytes = onednn.packed_bytes(model)
    alone = {n: onednn.run(x, getattr(a, n)._specmesh_onednn, getattr(a, n).bias) for n in ("q_proj", "k_proj", "v_proj")}
    assert lean_hf.prepare(model)
    lay = model._specmesh_lean_hf_layers[0]
    assert lay.qkv is not None and lay.gate_up is not None
    assert a.q_proj._specmesh_onednn is None and onednn.is_packed(a.q_proj)  # its own copy dropped
    assert onednn.packed_bytes(model) == before_bytes  # the stacks hold what the members held
    assert lean_hf._cpp_plan(lay, 1)[0] == [(0, 1)] * 4  # so a default step's layers take the C++ halves
    whole = onednn.run(x, lay.qkv._specmesh_onednn, lay.qkv.bias)
    for (lo, hi), n in zip(lay.qkv.cols, ("q_proj", "k_proj", "v_proj")):
        assert torch.equal(whole[:, lo:hi], alone[n])
        assert torch.equal(onednn.apply_of(getattr(a, n))(x, None), alone[n])  # a member called alone


@pytest.mark.skipif(not onednn.available(), reason="torch without oneDNN's prepacked bf16 linears on this CPU")
def test_a_stack_that_is_not_bitwise_is_refused(monkeypatch):
    model = _model("llama", torch.bfloat16)
    mlp = model.model.layers[0].mlp
    real = onednn.run

    def off_by_one_ulp(x, wp, bias):  # a stacked call (wider than any member) that sums differently
        y = real(x, wp, bias)
        return y * (1 + 2**-7) if y.shape[1] == mlp.gate_proj.out_features + mlp.up_proj.out_features else y

    monkeypatch.setattr(onednn, "run", off_by_one_ulp)
    monkeypatch.setattr(onednn_stack, "_STACK_OK", {})
    monkeypatch.setenv("SPECMESH_PROBE_CACHE", "off")
    assert onednn_stack.stack(model, [mlp.gate_proj, mlp.up_proj]) is None
    assert mlp.gate_proj._specmesh_onednn is not None  # the members keep their own copies
