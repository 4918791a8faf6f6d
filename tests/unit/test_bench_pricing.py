"""`specmesh bench --price`: the flag's validation, the instances each mode uses, $ per 1M output
tokens (hand-computed), and the JSON / markdown / plot it adds. Synthetic runs, no mesh."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from specmesh.bench import compare, metrics, pricing, report, run
from specmesh.bench.metrics import RequestRecord
from specmesh.bench.pricing import Fleet, add_costs, instances, parse_prices, usd_per_million
from specmesh.cli import parser


def bench_args(*argv):
    return parser().parse_args(["bench", *argv])


def test_parse_prices():
    assert parse_prices("draft=0.9,target=3.5") == {"draft": 0.9, "target": 3.5}
    assert parse_prices(" target = 2 , gateway=0.1,coordinator=0") == {"target": 2.0, "gateway": 0.1,
                                                                        "coordinator": 0.0}


@pytest.mark.parametrize("text, message", [
    ("", "TIER=USD_PER_HOUR pairs"),
    ("target", "expected TIER=USD_PER_HOUR"),
    ("target:3.5", "expected TIER=USD_PER_HOUR"),
    ("=3.5", "expected TIER=USD_PER_HOUR"),
    ("target=", "expected TIER=USD_PER_HOUR"),
    ("draft=0.9,,target=3", "expected TIER=USD_PER_HOUR"),
    ("gpu=2", "unknown tier 'gpu'"),
    ("target=-1", "finite number >= 0"),
    ("target=nan", "finite number >= 0"),
    ("target=inf", "finite number >= 0"),
    ("target=cheap", "not a number"),
    ("target=1,target=2", "priced twice"),
])
def test_bad_prices_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        parse_prices(text)


def test_the_flag_fails_before_anything_starts(capsys):
    assert bench_args("--price", "draft=0.9,target=3.5").price == {"draft": 0.9, "target": 3.5}
    assert bench_args().price is None
    for bad, message in (("gpu=1", "unknown tier 'gpu'"), ("target=-3", ">= 0"), ("target3.5", "TIER=USD")):
        with pytest.raises(SystemExit) as exc:
            bench_args("--price", bad)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "argument --price" in err and message in err, err


def test_price_is_refused_with_micro_and_context(capsys):
    assert run(bench_args("--micro", "--price", "target=1")) == 2
    assert "--price" in capsys.readouterr().err
    assert run(bench_args("--context", "--price", "target=1")) == 2


def test_instances_per_mode():
    fleet = Fleet(draft=2, target=3)
    assert instances("ar", None, fleet) == {"draft": 0, "target": 3, "gateway": 1, "coordinator": 1}
    assert instances("spec", "draft_model", fleet) == {"draft": 2, "target": 3, "gateway": 1, "coordinator": 1}
    assert instances("spec", "ngram", fleet) == {"draft": 2, "target": 3, "gateway": 1, "coordinator": 1}
    local = frozenset({"ngram"})  # coordinator.local_ngram: drafted in the coordinator
    assert instances("spec", "ngram", fleet, local)["draft"] == 0
    assert instances("spec", "block", fleet, local)["draft"] == 2
    for peer in ("hf_generate", "hf_prompt_lookup", "hf_assisted"):
        assert instances(peer, None, fleet) == {"draft": 0, "target": 1, "gateway": 0, "coordinator": 0}


def test_fleet_comes_from_the_run():
    cfg = SimpleNamespace(coordinator=SimpleNamespace(local_ngram=True))
    fleet, local, source = pricing.fleet_of(bench_args("--draft-workers", "2", "--target-workers", "4"), cfg)
    assert fleet == Fleet(draft=2, target=4) and local == {"ngram"} and "local stack" in source
    cfg.coordinator.local_ngram = False
    fleet, local, source = pricing.fleet_of(bench_args("--target", "10.0.0.1:50051"), cfg)
    assert fleet == Fleet(1, 1) and not local and "declared" in source


def rec(pid: str, tokens: int) -> RequestRecord:
    return RequestRecord(prompt_id=pid, category="writing", chunk_times=[0.1 * (i + 1) for i in range(tokens)],
                         chunk_tokens=[1] * tokens, token_ids=list(range(tokens)), latency=0.1 * tokens)


def run_row(mode: str, drafter, conc: int, tokens_per_s: float) -> dict:
    records = [rec("a", 4), rec("b", 4)]
    row = {"mode": mode, "drafter": drafter, "concurrency": conc, "request_rate": None,
           "batch_1_only": mode.startswith("hf_")}
    row.update(metrics.aggregate(records, wall_s=1.0))
    row.update(output_tokens_per_s=tokens_per_s, _records=records,
               requests=[{"prompt_id": r.prompt_id, "e2e_ms": r.latency * 1e3} for r in records])
    return row


def priced_doc(prices: dict, fleet: Fleet = Fleet(), local=frozenset()) -> dict:
    runs = [run_row("spec", "draft_model", 1, 20.0), run_row("spec", "ngram", 1, 18.0), run_row("ar", None, 1, 10.0),
            run_row("hf_generate", None, 1, 12.0), run_row("spec", "draft_model", 2, 30.0),
            run_row("ar", None, 2, 0.0)]
    args = bench_args("--compare", "--drafters", "draft_model,ngram")
    args.k = 4
    doc = compare.summarize_runs(runs, args, 2)
    add_costs(doc, prices, fleet, frozenset(local), "test")
    return doc


def test_dollars_per_million_output_tokens():
    assert usd_per_million(3.6, 1.0) == pytest.approx(1e6 / 1000)  # $3.6/h at 1 tok/s: $1 per 1000 tokens
    assert usd_per_million(3.5, 0.0) is None
    doc = priced_doc({"draft": 0.9, "target": 3.5}, local={"ngram"})
    by = {(r["mode"], r["drafter"], r["concurrency"]): r["cost"] for r in doc["runs"]}
    ar = by["ar", None, 1]
    assert ar["usd_per_hour"] == pytest.approx(3.5)
    assert ar["usd_per_million_output_tokens"] == pytest.approx(3.5 / (10 * 3600) * 1e6)  # 97.22
    dm = by["spec", "draft_model", 1]
    assert dm["usd_per_hour"] == pytest.approx(4.4)
    assert dm["usd_per_million_output_tokens"] == pytest.approx(4.4 / (20 * 3600) * 1e6)  # 61.11
    assert dm["vs_ar"] == pytest.approx((4.4 / 20) / (3.5 / 10))
    ngram = by["spec", "ngram", 1]  # local n-gram: no draft worker to pay for
    assert ngram["instances"]["draft"] == 0 and ngram["usd_per_hour"] == pytest.approx(3.5)
    assert by["hf_generate", None, 1]["usd_per_million_output_tokens"] == pytest.approx(3.5 / (12 * 3600) * 1e6)
    assert by["ar", None, 2]["usd_per_million_output_tokens"] is None  # nothing produced
    assert by["spec", "draft_model", 2]["vs_ar"] is None
    assert doc["price"]["usd_per_instance_hour"] == {"draft": 0.9, "target": 3.5}
    assert doc["price"]["fleet"] == {"draft": 1, "target": 1, "gateway": 1, "coordinator": 1}


def test_priced_gateway_and_coordinator_count_for_mesh_modes_only():
    doc = priced_doc({"target": 3.0, "gateway": 0.5, "coordinator": 0.5}, fleet=Fleet(draft=1, target=2))
    by = {(r["mode"], r["drafter"], r["concurrency"]): r["cost"] for r in doc["runs"]}
    assert by["ar", None, 1]["usd_per_hour"] == pytest.approx(2 * 3.0 + 1.0)
    assert by["spec", "ngram", 1]["usd_per_hour"] == pytest.approx(2 * 3.0 + 1.0)  # draft tier unpriced
    assert by["hf_generate", None, 1]["usd_per_hour"] == pytest.approx(3.0)


def test_json_markdown_and_plot(tmp_path):
    doc = priced_doc({"draft": 0.9, "target": 3.5}, local={"ngram"})
    written = {p.name for p in report.write_all(doc, tmp_path / "b.json")}
    assert "b_cost.png" in written
    saved = json.loads((tmp_path / "b.json").read_text())
    report.check_schema(saved)
    assert saved["runs"][0]["cost"]["usd_per_million_output_tokens"] > 0
    md = (tmp_path / "b.md").read_text()
    assert "### Cost per million output tokens (USD per instance-hour: draft 0.9, target 3.5)" in md
    assert "drafted in the coordinator, no draft tier: ngram" in md
    assert "| spec | draft_model | 1 | 1/1/1/1 | 4.40 | 20.00 | 61.11 | 0.63x |" in md
    assert "| ar | - | 1 | 0/1/1/1 | 3.50 | 10.00 | 97.22 | 1.00x |" in md
    assert "| hf_generate | - | 1 | 0/1/0/0 | 3.50 | 12.00 | 81.02 |" in md
    assert "output_tokens_per_s * 3600" in md  # the formula is in the report
    broken = json.loads(json.dumps(saved))
    del broken["runs"][1]["cost"]
    assert any("runs[1].cost" in e for e in report.schema_errors(broken))


def test_unpriced_runs_have_no_cost(tmp_path):
    doc = priced_doc({"target": 1.0})
    del doc["price"]
    for r in doc["runs"]:
        del r["cost"]
    written = {p.name for p in report.write_all(doc, tmp_path / "b.json", plots=True)}
    assert "b_cost.png" not in written and "Cost per million" not in (tmp_path / "b.md").read_text()


def test_a_run_refuses_to_replace_a_hand_written_page_beside_its_out(tmp_path, capsys):
    page = tmp_path / "notes.md"
    page.write_text("# My notes on this machine\n")
    assert run(bench_args("--micro", "--out", str(tmp_path / "notes.json"))) == 2
    assert "notes.md exists and is not a bench report" in capsys.readouterr().err
    assert page.read_text() == "# My notes on this machine\n"
    from specmesh.bench import foreign_report

    page.write_text("## specmesh bench --micro: one verify forward (batched_step), context 256 tokens\n")
    assert foreign_report(bench_args("--micro", "--out", str(tmp_path / "notes.json"))) is None  # its own report
    assert foreign_report(bench_args("--out", str(tmp_path / "fresh.json"))) is None
    page.write_text("# My notes\n")
    assert foreign_report(bench_args("--context", "--out", str(tmp_path / "notes.json"))) is None  # writes no .md
