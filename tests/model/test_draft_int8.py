"""`draft_worker.draft_model.weights: int8` on the real default model: `specmesh bench --micro
--micro-draft` times the draft as the draft worker runs it, and its int8 drafting steps stay close
to the model's own (the top token mostly the same; what the target verifies is unchanged)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specmesh.cli import main
from specmesh.engine import quant
from specmesh.engine.kv import batched_step
from specmesh.engine.pool import new_sequence_kv

pytestmark = pytest.mark.model


def test_micro_times_the_int8_draft(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMESH_DRAFT_WORKER__DRAFT_MODEL__WEIGHTS", "int8")
    out = tmp_path / "draft.json"
    assert main(["bench", "--micro", "--micro-draft", "--micro-context", "16", "--micro-positions", "1",
                 "--micro-batch", "1,2", "--micro-trees", "", "--micro-repeats", "1", "--no-progress",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["draft"] and doc["weights"] == "int8"
    assert [(r["mode"], r["batch"]) for r in doc["results"]] == [("batched", 1), ("batched", 2)]
    assert "draft model, " in out.with_suffix(".md").read_text()


def test_int8_drafting_steps_track_the_model(target_model):
    quantized = copy.deepcopy(target_model)
    assert quant.quantize(quantized) > 0
    ids = torch.randint(100, 40000, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    tops = []
    for model in (target_model, quantized):
        kv = new_sequence_kv(model, capacity=len(ids))
        batched_step(model, [kv], [ids[:16]])
        kv.commit(16)
        rows = []
        for t in ids[16:]:  # one-token steps: the int8 path
            rows.append(batched_step(model, [kv], [[t]])[0].logits[0].argmax())
            kv.commit(1)
        tops.append(torch.stack(rows))
    assert (tops[0] == tops[1]).float().mean() >= 0.8
