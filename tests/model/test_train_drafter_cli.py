"""`specmesh train-drafter` / `specmesh eval-drafter` as a user runs them, on the real target and a
2-prompt slice of ShareGPT: data generated and cached, a few training steps, a checksummed bf16
artefact, a resumed run, and the offline acceptance evaluation of that artefact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specmesh.drafters.artifact import verify_manifest

pytestmark = pytest.mark.model
CLI = [sys.executable, "-m", "specmesh.cli"]
SMALL = ["--num-layers", "1", "--intermediate-size", "64", "--batch-size", "4", "--threads", "1", "--log-seconds", "5"]


def run(*argv, timeout=600):
    out = subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def test_train_then_eval_drafter(tmp_path, model_dir):
    data, art, ckpt = tmp_path / "data", tmp_path / "art", tmp_path / "ckpt"
    base = ["train-drafter", "--data", str(data), "--ckpt-dir", str(ckpt), "--export-dir", str(art),
            "--data-prompts", "2", "--max-steps", "4", *SMALL]
    run(*base, "--stop-at-step", "2", "--data-minutes", "5")
    (shard,) = sorted((data / "train").glob("shard_*.pt"))  # 2 prompts answered by the target, cached
    verify_manifest(art)  # bf16 weights + config, checksummed
    resumed = run(*base, "--data-minutes", "0")  # no new data; resumes at step 2
    assert "resumed from" in resumed.stdout and json.loads(resumed.stdout[resumed.stdout.index("\n{\n"):])["step"] == 4
    assert json.loads((art / "training.json").read_text())["step"] == 4
    # evaluate on the cached slice (stand-in for the MT-Bench split, which takes minutes to generate)
    (tmp_path / "eval" / "mtbench").mkdir(parents=True)
    (tmp_path / "eval" / "mtbench" / shard.name).symlink_to(shard)
    out = run("eval-drafter", "--drafter", str(art), "--data", str(tmp_path / "eval"),
              "--out", str(tmp_path / "eval.json"))
    overall = json.loads((tmp_path / "eval.json").read_text())[str(art)]["overall"]
    assert overall["rounds"] > 0 and 1.0 <= overall["mean_acceptance_length"] <= 8.0
    assert str(art) in out.stdout


def test_train_drafter_without_data_says_how_to_get_it(tmp_path, model_dir):
    out = subprocess.run([*CLI, "train-drafter", "--data", str(tmp_path / "none"), "--data-minutes", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--data-minutes" in out.stdout
