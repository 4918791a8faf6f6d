"""specmesh plan: the memory formulas of docs/capacity.md on a hand-written config.json."""

from __future__ import annotations

import json

import pytest

from specmesh.capacity import Plan, model_shape
from specmesh.cli import main

CONFIG = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
          "intermediate_size": 12288, "vocab_size": 151936, "head_dim": 128, "tie_word_embeddings": False}


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    return d


def test_kv_formula_and_tiers(model_dir):
    shape = model_shape(str(model_dir))
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.params_source) == (32, 8, 128, "config")
    assert shape.kv_bytes_per_token(2) == 2 * 32 * 8 * 128 * 2
    plan = Plan(shape, None, concurrency=16, context=4096, k=4, dtype="bfloat16")
    tiers = plan.tiers()
    t = tiers["target_worker"]
    assert t["kv_cache"] == 2 * 32 * 8 * 128 * (4096 + 65) * 16 * 2  # the pool: context + one round's drafts
    assert "verify_kv" not in t  # drafts are verified in place inside the pool
    assert t["verify_logits_fp32"] == 5 * 151936 * 4 * 16
    assert t["weights"] == shape.params * 2 and 7e9 < shape.params < 8.5e9  # an 8B-class estimate
    assert t["total"] == sum(v for k, v in t.items() if k != "total")
    assert tiers["draft_worker"]["total"] == 0  # n-gram drafting


def test_draft_model_tier(model_dir):
    shape = model_shape(str(model_dir / "config.json"))
    plan = Plan(shape, shape, concurrency=2, context=100, k=3, dtype="float32")
    d = plan.tiers()["draft_worker"]
    assert d["kv_cache"] == 2 * 32 * 8 * 128 * 100 * 2 * 4 and d["propose_kv"] == 2 * 32 * 8 * 128 * 3 * 2 * 4
    assert plan.as_dict()["config"]["target_worker.cache.max_tokens"] == 2 * (100 + 65)


def test_text_config_and_default_head_dim(tmp_path):
    nested = {"text_config": {k: v for k, v in CONFIG.items() if k != "head_dim"}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert model_shape(str(tmp_path)).head_dim == 4096 // 32


def test_plan_cli_prints_formula_and_json(model_dir, capsys):
    assert main(["plan", "--model", str(model_dir), "--concurrency", "4", "--context", "1024"]) == 0
    out = capsys.readouterr().out
    assert "KV pool" in out and f"2 x 32 x 8 x 128 x {4 * (1024 + 65)} slots x 2 B" in out
    assert "5 x 151936 vocab x 4 B" in out
    assert main(["plan", "--model", str(model_dir), "--concurrency", "4", "--context", "1024", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2
    assert main(["plan", "--model", str(model_dir / "nope"), "--concurrency", "1", "--context", "1"]) == 2


def test_int8_draft_weights_add_a_one_byte_copy(model_dir, capsys):
    shape = model_shape(str(model_dir))
    d = Plan(shape, shape, concurrency=2, context=100, k=3, dtype="bfloat16", draft_weights="int8").tiers()["draft_worker"]
    assert d["int8_copy"] == shape.params and d["weights"] == 2 * shape.params
    assert d["total"] == sum(v for k, v in d.items() if k != "total")
    args = ["plan", "--model", str(model_dir), "--concurrency", "2", "--context", "100", "--draft-model", str(model_dir)]
    assert main(args) == 0 and "int8 copy" not in capsys.readouterr().out
    assert main([*args, "--draft-weights", "int8"]) == 0 and "int8 copy" in capsys.readouterr().out
