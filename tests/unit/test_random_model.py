"""specmesh.bench.random_model: a random-weight HF dir of a config's shapes, loadable by the engine."""

from __future__ import annotations


def test_random_model_has_the_config_shapes_and_loads(tmp_path):
    from transformers import LlamaConfig

    from specmesh.bench.random_model import main
    from specmesh.engine.loader import load_model

    src = tmp_path / "src"
    LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128).save_pretrained(src)
    assert main([str(tmp_path / "out"), "--config", str(src)]) == 0
    model = load_model(tmp_path / "out", "float32")
    assert model.config.hidden_size == 32 and len(model.model.layers) == 2
    again = tmp_path / "again"
    main([str(again), "--config", str(src)])  # same seed: the same weights
    assert all(a.equal(b) for a, b in zip(model.parameters(), load_model(again, "float32").parameters()))
