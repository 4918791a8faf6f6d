"""The block drafter's head over the most frequent tokens (draft_worker.block.head_vocab): the
ranking (specmesh/training/vocab.py, `specmesh drafter-vocab`), its file in the artefact, and the
draft worker drafting from the kept tokens only, losslessly at T > 0."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from draft_worker.block_loader import head_vocab_ids
from draft_worker.drafters import BlockDrafter, ProposeJob
from specmesh.config import ConfigError, load_config
from specmesh.core.types import SamplingParams
from specmesh.drafters.artifact import RANK_NAME, head_ids, load_rank, verify_manifest
from specmesh.errors import ModelIntegrityError
from specmesh.training.vocab import count_tokens, rank_tokens
from tests.unit.test_block_worker import V, rows, tiny_block_model

SHIPPED = Path(__file__).resolve().parents[2] / "artifacts" / "drafters" / "smollm2-135m-instruct-block"


def test_tokens_are_ranked_specials_first_then_by_count_then_by_id():
    counts = count_tokens([[3, 3, 5, 1], [5, 3, 0]], vocab_size=7)
    assert counts.tolist() == [1, 1, 0, 3, 0, 2, 0]
    assert rank_tokens(counts, first=[6]).tolist() == [6, 3, 5, 0, 1, 2, 4]


def test_head_ids_are_the_most_frequent_sorted_and_a_bad_ranking_is_refused(tmp_path):
    save_file({"rank": torch.tensor([4, 0, 2, 1, 3], dtype=torch.int32)}, str(tmp_path / RANK_NAME))
    assert head_ids(tmp_path, 5, 3).tolist() == [0, 2, 4]
    with pytest.raises(ValueError, match="not a ranking"):
        head_ids(tmp_path, 6, 3)
    save_file({"rank": torch.tensor([4, 0, 0, 1, 3], dtype=torch.int32)}, str(tmp_path / RANK_NAME))
    with pytest.raises(ValueError, match="not a ranking"):
        head_ids(tmp_path, 5, 3)
    with pytest.raises(ValueError, match="drafter-vocab"):
        head_ids(tmp_path / "none", 5, 3)


def test_the_shipped_ranking_is_checksummed_and_starts_with_the_end_of_a_turn():
    verify_manifest(SHIPPED)
    assert RANK_NAME in (SHIPPED / "MANIFEST.sha256").read_text()
    rank = load_rank(SHIPPED)
    vocab = json.loads((SHIPPED / "config.json").read_text())["vocab_size"]
    assert torch.equal(torch.sort(rank.long()).values, torch.arange(vocab))
    assert rank[0] == 2  # SmolLM2's <|im_end|>, its EOS: a reply's end is always draftable


def _cfg(path: Path, keep: int):
    return load_config(overrides={"draft_worker": {"block": {"path": str(path), "head_vocab": keep}}})


def test_the_worker_keeps_the_configured_head_or_every_token(tmp_path, caplog):
    shutil.copy(SHIPPED / "config.json", tmp_path / "config.json")
    with caplog.at_level(logging.WARNING):
        assert head_vocab_ids(_cfg(tmp_path, 8192), 49152) is None  # no ranking: every token, logged
    assert "drafter-vocab" in caplog.text
    shutil.copy(SHIPPED / RANK_NAME, tmp_path / RANK_NAME)
    ids = head_vocab_ids(_cfg(tmp_path, 8192), 49152)
    assert ids.shape == (8192,) and torch.equal(ids, torch.sort(load_rank(SHIPPED)[:8192].long()).values)
    assert head_vocab_ids(_cfg(tmp_path, 0), 49152) is None
    with pytest.raises(ModelIntegrityError):
        head_vocab_ids(_cfg(tmp_path, 8192), 50000)  # a ranking of another vocabulary
    with pytest.raises(ConfigError, match="head_vocab"):
        _cfg(tmp_path, -1)


KEEP = torch.tensor([1, 4, 7, 10, 13, 20, 33, 47])  # token ids the head scores


@pytest.fixture(scope="module")
def pair():
    full = BlockDrafter(tiny_block_model(0), max_batch_size=4, cache_max_sequences=8)
    kept = BlockDrafter(tiny_block_model(0), max_batch_size=4, cache_max_sequences=8, head_ids=KEEP)
    yield full, kept
    full.close()
    kept.close()


def _job(seq, params=SamplingParams(), tree=0, candidates=False):
    return ProposeJob(seq, list(range(1, 10)), 4, params, 0, rows(2, 8), True, tree, candidates=candidates)


def test_drafts_are_the_kept_tokens_best_as_the_full_head_ranks_them(pair):
    full, kept = pair
    assert kept.head.weight.shape == (len(KEEP), kept.model.cfg.hidden_size)
    logq, tokens = full.propose(_job("a", tree=V, candidates=True)).candidates  # every token, ranked
    klogq, ktokens = kept.propose(_job("a", tree=4, candidates=True)).candidates
    for row, krow in zip(tokens.tolist(), ktokens.tolist()):
        assert krow == [t for t in row if t in KEEP.tolist()][:4]  # the full ranking, cut to the kept set
    chain = kept.propose(_job("b")).token_ids
    assert chain == ktokens[:, 0].tolist()  # greedy: each position's best kept token
    tree = kept.propose(_job("c", tree=6))
    assert set(tree.token_ids) <= set(KEEP.tolist()) and len(tree.parents) == 6


def test_a_sampled_chain_from_kept_tokens_sends_its_distribution_over_every_token(pair):
    _, kept = pair
    d = kept.propose(_job("d", params=SamplingParams(temperature=1.0, seed=7)))
    assert d.probs.shape == (4, V) and torch.allclose(d.probs.sum(-1), torch.ones(4))
    outside = torch.ones(V, dtype=torch.bool)
    outside[KEEP] = False
    assert (d.probs[:, outside] == 0).all()  # q is 0 outside the kept set: rejection sampling stays exact
    assert all(d.probs[i, t] > 0 for i, t in enumerate(d.token_ids)) and set(d.token_ids) <= set(KEEP.tolist())


def test_drafter_vocab_ranks_a_corpus_into_the_artefact(tmp_path, monkeypatch):
    from specmesh import cli
    from specmesh.training import data

    for name in ("config.json", "model.safetensors"):
        shutil.copy(SHIPPED / name, tmp_path / name)
    corpus = [("Name a color.", "It is" + " red" * 20), ("Say hi.", None)]
    monkeypatch.setattr(data, "_sharegpt_items", lambda cache_dir, seed: corpus)
    assert cli.main(["drafter-vocab", "--export-dir", str(tmp_path)]) == 0
    verify_manifest(tmp_path)
    assert RANK_NAME in (tmp_path / "MANIFEST.sha256").read_text()
    from transformers import AutoTokenizer

    from specmesh.training.data import resolve_target_dir

    tok = AutoTokenizer.from_pretrained(resolve_target_dir(None))
    rank = load_rank(tmp_path).tolist()
    specials = len(set([tok.eos_token_id, *tok.all_special_ids]))
    assert rank[0] == tok.eos_token_id
    red = tok(" red", add_special_tokens=False)["input_ids"]
    assert len(red) == 1 and rank.index(red[0]) == specials  # the corpus's most frequent, after the specials
