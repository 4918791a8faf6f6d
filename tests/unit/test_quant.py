"""Weight-only int8 for a draft model (specmesh/engine/quant.py), on a tiny random Llama: short
steps read the int8 copies (close to, not equal to, the model's own product), long ones (a
prefill) the model's weights bitwise, and a device or shape without the kernel is left alone."""

import copy

import pytest
import torch

from specmesh.engine import quant
from specmesh.engine.kv import batched_step
from specmesh.engine.pool import new_sequence_kv


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def pair(request):
    """(the model, its int8-quantized copy), same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg).eval().to(request.param)
    quantized = copy.deepcopy(model)
    assert quant.quantize(quantized) > 0
    return model, quantized


def logits(model, ids: list[int], chunk: int, hidden: bool = False) -> torch.Tensor:
    """Logits of every position of ids, forwarded `chunk` tokens per step: [len(ids), V] (hidden:
    the decoder's output instead, [len(ids), H])."""
    kv, out = new_sequence_kv(model, capacity=len(ids)), []
    for i in range(0, len(ids), chunk):
        step = batched_step(model, [kv], [ids[i : i + chunk]], hidden_layers=(2,) if hidden else ())[0]
        out.append(step.hidden_states[0] if hidden else step.logits)
        kv.commit(len(ids[i : i + chunk]))
    return torch.cat(out)


def test_rows_round_trip_within_half_a_step():
    w = torch.randn(40, 24) * torch.linspace(0.01, 10, 40)[:, None]  # rows of very different range
    q, scales = quant.quantize_rows(w)
    assert q.dtype == torch.int8 and scales.shape == (40,)
    assert ((q.float() * scales[:, None] - w).abs() <= scales[:, None] / 2 + 1e-6).all()


def test_short_steps_read_int8_and_stay_close(pair):
    model, quantized = pair
    ids = [int(t) for t in torch.randint(0, 96, (24,), generator=torch.Generator().manual_seed(1))]
    want, got = logits(model, ids, chunk=1), logits(quantized, ids, chunk=1)  # [24, V]
    assert not torch.equal(want, got)  # the int8 copies were read: the head's ...
    assert not torch.equal(logits(model, ids, 1, hidden=True), logits(quantized, ids, 1, hidden=True))  # and the decoder's
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_long_steps_keep_the_model_weights(pair):
    model, quantized = pair
    ids = [int(t) for t in torch.randint(0, 96, (2 * quant.ROWS,), generator=torch.Generator().manual_seed(2))]
    assert torch.equal(logits(model, ids, chunk=len(ids)), logits(quantized, ids, chunk=len(ids)))


def test_hf_forward_keeps_the_model_weights(pair):
    model, quantized = pair
    ids = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        assert torch.equal(model(ids[:, :1]).logits, quantized(ids[:, :1]).logits)  # outside an engine step


def test_quantize_leaves_the_model_alone_where_the_kernel_fails(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    def missing(*args):
        raise NotImplementedError("no int8 kernel on this device")

    monkeypatch.setattr(quant, "_int8_mm", missing)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    assert quant.quantize(model) == 0
    assert not any(hasattr(m, "_specmesh_int8") for m in model.modules())
