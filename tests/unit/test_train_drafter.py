"""Drafter training on a tiny synthetic slice: the loss falls, and resume is exact."""

import argparse
from pathlib import Path

import pytest
import torch
from torch import nn

from specmesh.training.corpus import AnchorSampler, load_corpus, make_batch
from specmesh.training.train import add_train_args, block_loss, build, position_weights, train_drafter

V, H = 64, 32


def write_slice(root: Path) -> Path:
    """8 sequences of 'count upwards' tokens (s_t = s_0 + t mod V) with random features."""
    g = torch.Generator().manual_seed(0)
    tokens, feats = [], []
    for i in range(8):
        start = int(torch.randint(1, V, (1,), generator=g))
        tokens.append((start + torch.arange(40)) % V)
        feats.append(torch.randn(40, 2 * H, generator=g).to(torch.bfloat16))
    shard = {"tokens": tokens, "prompt_len": [8] * 8, "feat_start": [0] * 8, "features": feats,
             "meta": [{"index": i} for i in range(8)]}
    (root / "train").mkdir(parents=True)
    torch.save(shard, root / "train" / "shard_00000.pt")
    return root


def tiny_args(tmp: Path, data: Path, name: str, **kw) -> argparse.Namespace:
    argv = ["--data", str(data), "--ckpt-dir", str(tmp / name / "ckpt"), "--export-dir", str(tmp / name / "art"),
            "--target-layers", "0", "1", "--num-layers", "1", "--num-heads", "4", "--num-kv-heads", "2",
            "--intermediate-size", "48", "--block-size", "4", "--injection-rank", "4", "--context-window", "6",
            "--batch-size", "16", "--lr", "1e-2", "--warmup-steps", "2", "--max-steps", "60", "--log-seconds", "60"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return add_train_args(argparse.ArgumentParser()).parse_args(argv)


def shared():
    torch.manual_seed(0)
    embed = nn.Embedding(V, H)
    head = nn.Linear(H, V, bias=False)
    head.weight = embed.weight
    embed.requires_grad_(False)
    return embed, head


def fixed_batch(data: Path, cfg):
    corpus = load_corpus(data / "train")
    picks = AnchorSampler(corpus, cfg.block_size).sample(32, torch.Generator().manual_seed(5))
    return make_batch(corpus, picks, cfg.block_size, cfg.context_window, cfg.mask_token_id)


def test_loss_falls(tmp_path):
    data = write_slice(tmp_path / "data")
    args = tiny_args(tmp_path, data, "run", stop_at_step=40)
    embed, head = shared()
    fresh, *_ = build(args, embed, head, None)
    batch = fixed_batch(data, fresh.cfg)
    w = position_weights(fresh.cfg.block_size, args.gamma)
    before = block_loss(fresh, batch, w)[0].item()
    summary = train_drafter(args, embed, head, None)
    assert summary["step"] == 40
    trained, _, _, step, _ = build(args, embed, head, None)  # resumes from the last checkpoint
    assert step == 40
    after = block_loss(trained, batch, w)[0].item()
    assert after < 0.5 * before, (before, after)
    assert (tmp_path / "run" / "art" / "MANIFEST.sha256").exists()


def test_resume_is_exact(tmp_path):
    data = write_slice(tmp_path / "data")
    embed, head = shared()
    train_drafter(tiny_args(tmp_path, data, "straight", stop_at_step=10), embed, head, None)
    train_drafter(tiny_args(tmp_path, data, "split", stop_at_step=5), embed, head, None)
    mid = torch.load(tmp_path / "split" / "ckpt" / "last.pt", weights_only=False)
    assert mid["step"] == 5
    train_drafter(tiny_args(tmp_path, data, "split", stop_at_step=10), embed, head, None)
    a = torch.load(tmp_path / "straight" / "ckpt" / "last.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "ckpt" / "last.pt", weights_only=False)
    assert a["step"] == b["step"] == 10
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert torch.equal(a["sampler_rng"], b["sampler_rng"])
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)


def test_truncated_json_array_is_read_up_to_the_cut():
    from specmesh.training.data import iter_json_array

    text = '[\n {"a": 1},\n {"a": [2, 3]},\n {"a": "tru'
    assert list(iter_json_array(text)) == [{"a": 1}, {"a": [2, 3]}]
    assert list(iter_json_array("[]")) == []


def test_position_weights_decay():
    w = position_weights(5, 2.0)
    assert w.shape == (4,) and w[0] == 1.0
    assert torch.allclose(w[1] / w[0], torch.exp(torch.tensor(-0.5)))


def test_init_from_an_artefact_starts_where_it_left_off(tmp_path):
    import pytest

    data = write_slice(tmp_path / "data")
    embed, head = shared()
    train_drafter(tiny_args(tmp_path, data, "first", stop_at_step=30), embed, head, None)
    art = tmp_path / "first" / "art"
    warm, _, _, step, extra = build(tiny_args(tmp_path, data, "warm", init_from=art), embed, head, None)
    cold, *_ = build(tiny_args(tmp_path, data, "cold"), embed, head, None)
    assert step == 0 and extra["init_from"] == str(art)  # fresh schedule, weights from the artefact
    batch = fixed_batch(data, warm.cfg)
    w = position_weights(warm.cfg.block_size, 4.0)
    assert block_loss(warm, batch, w)[0].item() < 0.7 * block_loss(cold, batch, w)[0].item()
    with pytest.raises(ValueError, match="config differs"):
        build(tiny_args(tmp_path, data, "other", init_from=art, block_size=5), embed, head, None)


def test_teacher_labels_are_the_targets_next_tokens(tmp_path):
    """features_and_labels on a tiny causal LM: labels[j] = argmax p(. | s_<j) past feat_start,
    and make_batch trains on labels (not the text) when a shard carries them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from specmesh.training.corpus import Corpus, chain_targets
    from specmesh.training.teacher import features_and_labels

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    seqs = [list(range(3, 23)), list(range(10, 22))]
    (f0, l0), (f1, l1) = features_and_labels(model, seqs, [0, 1], starts=[4, 0])
    assert f0.shape == (16, 2 * H) and f1.shape == (12, 2 * H) and f0.dtype == torch.bfloat16
    with torch.no_grad():
        greedy = model(torch.tensor([seqs[0]])).logits[0].argmax(-1)  # [20]: prediction of token j+1
    assert l0[:5].tolist() == seqs[0][:5]  # up to feat_start: the text itself
    assert l0[5:].tolist() == greedy[4:19].tolist()
    corpus = Corpus()
    corpus.add({"tokens": [torch.tensor(seqs[0])], "prompt_len": [6], "feat_start": [4], "features": [f0],
                "meta": [{}], "labels": [l0]})
    batch = make_batch(corpus, [(0, 8)], block_size=4, window=3, mask_token_id=0)
    text, labels = torch.tensor(seqs[0][9:12]), l0[9:12]
    assert batch["targets"][0, 0] == labels[0]  # position 1: always the target's own next token
    assert batch["targets"][0].tolist() == chain_targets(text, labels).tolist()
    assert batch["block_ids"][0].tolist() == [seqs[0][8], 0, 0, 0]


def test_chain_targets_stop_where_the_text_leaves_the_targets_path():
    from specmesh.training.corpus import IGNORE, chain_targets

    text = torch.tensor([5, 6, 7, 8])
    assert chain_targets(text, text.clone()).tolist() == [5, 6, 7, 8]  # regenerated: all kept
    # label 1 always kept; text[1] != label[1], so positions 3.. depend on a token the target would
    # not have emitted: ignored
    assert chain_targets(text, torch.tensor([5, 9, 7, 8])).tolist() == [5, 9, IGNORE, IGNORE]
    assert chain_targets(text, torch.tensor([1, 6, 7, 8])).tolist() == [1, IGNORE, IGNORE, IGNORE]


def test_block_loss_ignores_masked_targets():
    embed, head = shared()
    args = tiny_args(Path("/tmp"), Path("/tmp"), "x")
    drafter, *_ = build(args, embed, head, None)
    g = torch.Generator().manual_seed(0)
    batch = {"block_ids": torch.randint(1, V, (3, 4), generator=g), "ctx_feats": torch.randn(3, 6, 2 * H, generator=g),
             "ctx_valid": torch.ones(3, 6, dtype=torch.bool), "targets": torch.randint(0, V, (3, 3), generator=g)}
    w = position_weights(4, 4.0)
    masked = dict(batch, targets=batch["targets"].clone())
    masked["targets"][:, 2] = -100
    loss, acc = block_loss(drafter, masked, w)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = drafter.hidden(batch["block_ids"], batch["ctx_feats"], batch["ctx_valid"])[:, 1:]
        logits = drafter.lm_head(h.to(drafter.lm_head.weight.dtype))  # [3, 3, V]
    ce = torch.nn.functional.cross_entropy(logits.reshape(9, V), batch["targets"].reshape(-1),
                                           reduction="none").float().view(3, 3)
    expected = (ce[:, :2] * w[:2]).sum() / (3 * w[:2].sum())  # weighted mean over the kept targets only
    assert torch.allclose(loss.detach(), expected, rtol=1e-3)
    assert acc.shape == (3,) and acc[2] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a GPU: cuda is a valid device")
@pytest.mark.parametrize("command", ["train-drafter", "eval-drafter"])
def test_a_device_torch_cannot_use_is_refused_up_front(command, tmp_path, capsys):
    """--device cuda on a CPU-only torch: exit 2 with the reason, before any data or model is read."""
    from specmesh.cli import main

    rc = main([command, "--device", "cuda", "--data", str(tmp_path / "none")])
    assert rc == 2
    assert "sees no CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()
