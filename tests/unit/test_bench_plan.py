"""`specmesh bench --drafters` with per-drafter options: what each run asks of the mesh."""

from __future__ import annotations

import pytest

from specmesh.bench.runner import build_request
from specmesh.bench.datasets import Prompt
from specmesh.bench.suite import Mode, check_plan, parse_drafter, plan, request_options
from specmesh.cli import parser


def bench_args(*argv):
    return parser().parse_args(["bench", *argv])


def test_parse_drafter_options():
    assert parse_drafter("ngram") == ("ngram", None, None)
    assert parse_drafter("block:tree=16") == ("block", None, 16)
    assert parse_drafter("block:k=4:tree=0") == ("block", 4, 0)
    for bad in ("block:tree", "block:tree=x", "block:depth=3"):
        with pytest.raises(ValueError, match="options are"):
            parse_drafter(bad)


def test_each_variant_is_its_own_mode_and_request():
    args = bench_args("--drafters", "ngram,block:tree=8,block:k=3", "--compare", "--no-peers", "--k", "5")
    modes, _ = plan(args)
    assert [m.label for m in modes] == ["spec/ngram", "spec/block:tree=8", "spec/block:k=3", "ar"]
    prompt = Prompt(prompt_id="p0", prompt="hi", messages=None, category="writing")
    reqs = {m.label: build_request(prompt, 0, request_options(args, m, args.k)) for m in modes}
    tree = reqs["spec/block:tree=8"].speculation
    assert (tree.method, tree.num_speculative_tokens, tree.tree_budget) == ("block", 5, 8)
    chain = reqs["spec/block:k=3"].speculation
    assert (chain.method, chain.num_speculative_tokens, chain.HasField("tree_budget")) == ("block", 3, False)
    assert reqs["ar"].speculation.method == "off"
    with pytest.raises(ValueError):
        plan(bench_args("--drafters", "block:tree=big"))


def test_mode_label_keeps_the_options():
    assert Mode("spec", "block:tree=32").label == "spec/block:tree=32"


def test_check_plan_knows_drafters_by_their_method():
    modes, levels = plan(bench_args("--drafters", "block:tree=4,ngram:k=2"))
    assert check_plan(modes, levels) is None
    modes, levels = plan(bench_args("--drafters", "eagle:tree=4"))
    assert "unknown drafter(s) eagle:tree=4" in check_plan(modes, levels)


def test_mesh_target_yields_the_gateway_and_a_target_worker_or_none():
    """Both callers (the suite and --context) unpack (gateway, worker); with --target the
    workers are unknown."""
    from types import SimpleNamespace

    from specmesh.bench.suite import mesh_target

    with mesh_target(SimpleNamespace(target="127.0.0.1:1"), ["ngram"]) as (gateway, worker):
        assert gateway == "127.0.0.1:1" and worker is None


def test_peers_follow_the_config_and_the_peers_option():
    """hf_assisted only where a draft model of its own is configured; --peers picks among them."""
    from specmesh.bench.peers import peer_modes
    from specmesh.config import load_config

    plain = load_config()  # the default config: the target drafts for itself, no assistant peer
    pair = load_config(overrides={"draft_worker": {"draft_model": {"name": "qwen2.5-coder-0.5b-instruct"}}})
    assert peer_modes(plain) == ("hf_generate", "hf_prompt_lookup")
    assert peer_modes(pair) == ("hf_generate", "hf_prompt_lookup", "hf_assisted")
    modes, _ = plan(bench_args("--drafters", "draft_model", "--compare"), ("hf_generate", "hf_assisted"))
    assert [m.label for m in modes] == ["spec/draft_model", "ar", "hf_generate", "hf_assisted"]
