"""oneDNN's prepacked bf16 linears inside engine steps (specmesh/engine/onednn.py), on a small
random bf16 Llama: a step's linears run from the prepacked weights only where the probe found
them bitwise F.linear's, so a one-token step and a prompt's prefill compute what the same model
without them computes, bit for bit; HF's own forward is untouched; deterministic verification
on top of them is still bitwise the target alone; rowexact counts probed on F.linear are never
paired with prepacked steps; float32 models get none."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine import onednn, rowexact
from specmesh.engine.kv import batched_step

pytestmark = pytest.mark.skipif(not onednn.available(), reason="torch without oneDNN's prepacked bf16 linears on this CPU")


def _model(dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).to(dtype).eval()


@pytest.fixture(scope="module")
def pair():
    """(plain, prepacked): the same weights; skipped where the probe prepacked nothing here."""
    plain, packed = _model(), _model()
    report = onednn.install(packed)
    if not any(v["packed"] for v in report.values()):
        pytest.skip(f"no prepacked linear is bitwise F.linear's and faster on this CPU: {report}")
    return plain, packed


def test_install_reports_every_shape_and_prepacks_only_bitwise_equal_ones(pair):
    _, packed = pair
    report = onednn.install(packed)
    assert onednn.install(packed) is report  # idempotent
    assert set(report) == {"512x512", "128x512", "1024x512", "512x1024", "2048x512"}
    for rows in report.values():
        assert not rows["packed"] or (rows["equal_rows"] >= 1 and rows["gain"] >= 1.0)
    assert onednn.packed_bytes(packed) > 0


def test_steps_are_bitwise_the_plain_models(pair, prefilled):
    """A one-token step, a 5-row verify within equal_rows, and a prefill longer than it."""
    plain, packed = pair
    prompt = [(7 * i + 3) % 2048 for i in range(60)]  # 60 rows: past any equal_rows found (<= 40)
    kvs = [prefilled(m, prompt) for m in (plain, packed)]
    assert torch.equal(kvs[0].keys(0, 60), kvs[1].keys(0, 60))  # the prefill's KV: F.linear's
    for rows in ([5], [5, 6, 7, 8, 9]):
        a, b = (batched_step(m, [kv], [rows])[0].logits for m, kv in zip((plain, packed), kvs))
        assert torch.equal(a, b)


def test_hf_forward_outside_steps_is_untouched(pair):
    plain, packed = pair
    ids = torch.tensor([[1, 5, 9, 200, 31]])
    with torch.inference_mode():
        assert torch.equal(plain(ids).logits, packed(ids).logits)


def test_deterministic_verify_on_prepacked_linears_is_the_target_alone(pair, prefilled, one_token_steps):
    _, packed = pair
    rowexact.install(packed)
    prompt, drafts = [3, 9, 4, 17, 8, 100, 2], [5, 6, 7, 1000, 12, 13]
    exact = batched_step(packed, [prefilled(packed, prompt)], [drafts], row_exact=True)[0].logits
    assert torch.equal(exact, one_token_steps(packed, prompt, drafts))


def test_not_installed_after_rowexact_or_in_float32():
    late = rowexact.install(_model())
    assert onednn.install(late) == {} and onednn.packed_bytes(late) == 0
    fp32 = _model(torch.float32)
    assert onednn.install(fp32) == {} and onednn.packed_bytes(fp32) == 0


def test_a_step_with_a_prefill_keeps_f_linear_past_equal_rows(pair):
    _, packed = pair
    mod = packed.model.layers[0].mlp.down_proj
    limit = mod._specmesh_onednn_equal
    small, large = torch.randn(limit, 1024).bfloat16(), torch.randn(limit + 1, 1024).bfloat16()
    with onednn.step(prefill=True):
        assert onednn.packed(mod, small) is not None and onednn.packed(mod, large) is None
    with onednn.step(prefill=False):
        assert onednn.packed(mod, large) is not None
    assert onednn.packed(mod, small.float()) is None  # another dtype: F.linear


def test_row_buckets_pad_little_and_stay_few():
    """Calls run at bucket(m) rows: never fewer than m, at most 7 rows of padding up to 128 rows
    (a call's time grows with its rows there), and few distinct counts (oneDNN keeps a primitive
    per input shape)."""
    got = [onednn.bucket(m) for m in range(1, 513)]
    assert all(b >= m for m, b in zip(range(1, 513), got))
    assert all(b == m for m, b in zip(range(1, 33), got))
    assert max(b - m for m, b in zip(range(1, 129), got)) <= 7
    assert len(set(got[:256])) <= 56
    assert all(onednn.bucket(b) == b for b in set(got))  # a bucket runs as itself
