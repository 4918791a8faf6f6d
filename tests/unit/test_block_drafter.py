"""Block drafter: shapes, attention structure, causal-injection switch, shared weights, artefact."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specmesh.drafters.artifact import export_drafter, load_drafter, verify_manifest
from specmesh.drafters.block import (BlockDrafter, BlockDrafterConfig, CausalInjection, extract_target_features,
                                     grouped_attention, top_k_per_position)

V, H, N, C = 64, 32, 3, 6


def tiny_cfg(**kw) -> BlockDrafterConfig:
    base = dict(target_layers=(0, 1), target_hidden_size=H, hidden_size=H, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, intermediate_size=48, block_size=4, mask_token_id=0,
                causal_injection=True, injection_rank=4, context_window=C, vocab_size=V)
    base.update(kw)
    return BlockDrafterConfig(**base)


def shared():
    torch.manual_seed(0)
    embed = nn.Embedding(V, H)
    head = nn.Linear(H, V, bias=False)
    head.weight = embed.weight  # tied, like SmolLM2
    embed.requires_grad_(False)
    return embed, head


def inputs(cfg):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (N, cfg.block_size), generator=g)  # [N, B]
    feats = torch.randn(N, C, cfg.feature_size, generator=g)  # [N, C, F]
    valid = torch.ones(N, C, dtype=torch.bool)  # [N, C]
    valid[0, :2] = False  # row 0: left padding
    return ids, feats, valid


def make(cfg=None, seed=0):
    embed, head = shared()
    torch.manual_seed(seed)
    return BlockDrafter(cfg or tiny_cfg(), embed, head)


def test_shapes_and_topk():
    d = make()
    ids, feats, valid = inputs(d.cfg)
    logits = d(ids, feats, valid)
    assert logits.shape == (N, 4, V) and logits.dtype == torch.float32
    assert d.draft(ids[:, 0], feats, valid).shape == (N, 3)
    logp, tok = top_k_per_position(logits, 5)
    assert logp.shape == tok.shape == (N, 3, 5)
    assert torch.all(logp[..., :-1] >= logp[..., 1:])
    assert torch.equal(tok[..., 0], logits[:, 1:].argmax(-1))


def test_block_ids_layout():
    d = make()
    ids = d.block_ids(torch.tensor([7, 9]))
    assert ids.tolist() == [[7, 0, 0, 0], [9, 0, 0, 0]]


def test_padded_context_is_ignored_and_block_is_bidirectional():
    d = make()
    ids, feats, valid = inputs(d.cfg)
    base = d(ids, feats, valid)
    noisy = feats.clone()
    noisy[0, :2] += 100.0  # only invalid (padding) slots changed
    assert torch.allclose(d(ids, noisy, valid), base, atol=1e-5)
    noisy[0, 3] += 1.0  # a valid context slot changes every block position
    assert not torch.allclose(d(ids, noisy, valid)[0], base[0], atol=1e-4)
    ids2 = ids.clone()
    ids2[:, -1] = (ids2[:, -1] + 1) % V  # last block token influences position 0: bidirectional
    assert not torch.allclose(d(ids2, feats, valid)[:, 0], base[:, 0], atol=1e-5)


def test_grouped_attention_matches_sdpa():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 3, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g),
               torch.randn(2, 2, 5, 8, generator=g))
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    mask[1, :, :, :2] = False
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert torch.allclose(grouped_attention(q, k, v, mask), ref, atol=1e-5)


def test_injection_starts_as_identity_and_switch_changes_outputs():
    with_inj = make(tiny_cfg(causal_injection=True))
    without = make(tiny_cfg(causal_injection=False))
    without.load_state_dict({k: v for k, v in with_inj.state_dict().items() if not k.startswith("injections")})
    ids, feats, valid = inputs(with_inj.cfg)
    assert torch.allclose(with_inj(ids, feats, valid), without(ids, feats, valid), atol=1e-6)  # U == 0
    for inj in with_inj.injections:
        nn.init.normal_(inj.up.weight, std=0.5)
    assert not torch.allclose(with_inj(ids, feats, valid), without(ids, feats, valid), atol=1e-3)
    assert not any(k.startswith("injections") for k in without.state_dict())


def test_injection_writes_only_previous_position():
    inj = CausalInjection(H, 4)
    nn.init.normal_(inj.up.weight)
    h = torch.randn(1, 5, H)
    out = inj(h)
    assert torch.equal(out[:, 0], h[:, 0])  # nothing flows into position 0
    h2 = h.clone()
    h2[:, 2] += 1.0
    changed = (inj(h2) - out).abs().sum(-1)[0]  # [5]
    assert changed[3] > 0 and changed[4] == 0 and changed[0] == 0 and changed[1] == 0


def test_shared_embedding_and_head_not_in_state_dict():
    d = make()
    keys = list(d.state_dict())
    assert not any("embed" in k or "lm_head" in k for k in keys)
    own = {id(p) for p in d.parameters()}
    assert id(d.embed_tokens.weight) not in own and id(d.lm_head.weight) not in own
    assert sum(v.numel() for v in d.state_dict().values()) == sum(p.numel() for p in d.parameters())


def test_artifact_round_trip(tmp_path):
    d = make()
    out = export_drafter(d, tmp_path / "art")
    verify_manifest(out)
    embed, head = shared()
    back = load_drafter(out, embed, head, dtype=torch.float32)
    assert back.cfg == d.cfg
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v.to(torch.bfloat16).float())
    (out / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes()[:-1] + b"\0")
    with pytest.raises(ValueError):
        verify_manifest(out)


def test_config_json_round_trip():
    import json

    cfg = tiny_cfg()
    assert BlockDrafterConfig.from_dict(json.loads(cfg.to_json())) == cfg
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 3


def test_extract_target_features_layer_mapping():
    hs = tuple(torch.full((1, 5, 2), float(i)) for i in range(4))  # embeddings + 3 layers
    out = extract_target_features(hs, [0, 2])
    assert out.shape == (5, 4)
    assert out[0].tolist() == [1.0, 1.0, 3.0, 3.0]  # layer i -> hidden_states[i + 1]
    with pytest.raises(ValueError):
        extract_target_features(hs, [3])
