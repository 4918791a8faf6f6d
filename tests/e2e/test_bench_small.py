"""`specmesh bench` end to end: the bench starts its own mesh (four OS processes on free ports),
runs 2 MT-Bench prompts at concurrency 1 and 2 with --compare (spec, AR, HF peers), --price and
two passes (the mesh's modes twice, the peers once), and writes a result that passes the schema check. Small on purpose (16 tokens): a few minutes on 2 cores.
"""

from __future__ import annotations

import json

import pytest
import yaml

from specmesh.bench.report import check_schema

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory, e2e):
    from specmesh.engine.fetch import model_cache_dir

    if not (model_cache_dir() / "model.safetensors").is_file():
        pytest.skip("default model not cached (run `specmesh fetch-model`)")
    tmp = tmp_path_factory.mktemp("bench")
    config = tmp / "bench.yaml"
    # fp32 on CPU: batched and unbatched argmax agree, so T=0 spec/AR identity is exact
    config.write_text(yaml.safe_dump({"model": {"dtype": "float32"}, "runtime": {"torch_threads": 1},
                                      "speculative": {"method": "ngram", "num_speculative_tokens": 4}}))
    out = tmp / "res" / "bench.json"
    proc = e2e.run_cli("bench", "--config", str(config), "--dataset", "mt-bench", "--limit", "2",
                       "--concurrency", "1,2", "--compare", "--max-tokens", "16", "--threads", "1",
                       "--price", "draft=0.9,target=3.5", "--passes", "2",
                       "--no-progress", "--log-dir", str(tmp / "logs"), "--out", str(out), timeout=900)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in (tmp / "logs").glob("*.log"))
    assert proc.returncode == 0, f"bench failed:\n{proc.stdout}\n{proc.stderr}\n{logs}"
    return proc, out


def test_bench_writes_a_valid_result(bench_run):
    proc, out = bench_run
    doc = json.loads(out.read_text())
    check_schema(doc)
    runs = {(r["mode"], r["drafter"], r["concurrency"]) for r in doc["runs"]}
    assert runs == {("spec", "ngram", 1), ("spec", "ngram", 2), ("ar", None, 1), ("ar", None, 2),
                    ("hf_generate", None, 1), ("hf_prompt_lookup", None, 1)}
    for r in doc["runs"]:
        passes = 1 if r["mode"].startswith("hf_") else 2  # the peers run in the first pass only
        assert r["num_requests"] == 2 * passes and r["num_errors"] == 0, r.get("errors_sample")
        assert r["output_tokens_per_s"] > 0 and len(r["pass_tokens_per_s"]) == passes
        if r["mode"] == "spec":
            assert len(r["speedup_passes"]) == 2 and all(x > 0 for x in r["speedup_passes"])
    assert "### Speed-up vs AR by pass" in proc.stdout
    assert doc["mismatch_checked"] and doc["mismatches"] == 0, doc["mismatch_details"]
    assert doc["command"].startswith("specmesh bench")
    for suffix in (".md", "_throughput.png", "_acceptance_by_category.png", "_latency_cdf.png", "_cost.png"):
        assert out.with_name(out.stem + suffix).is_file(), suffix
    assert "| mode | drafter | conc" in proc.stdout


def test_price_adds_dollars_per_million_tokens(bench_run):
    proc, out = bench_run
    doc = json.loads(out.read_text())
    # the default config drafts n-gram in the coordinator: no draft worker to pay for
    assert doc["price"]["fleet"] == {"draft": 1, "target": 1, "gateway": 1, "coordinator": 1}
    for r in doc["runs"]:
        c = r["cost"]
        assert c["usd_per_hour"] == pytest.approx(3.5) and c["instances"]["draft"] == 0  # one target instance
        assert c["usd_per_million_output_tokens"] == pytest.approx(3.5 / (r["output_tokens_per_s"] * 3600) * 1e6)
    assert "### Cost per million output tokens" in proc.stdout
