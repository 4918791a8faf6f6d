"""The trained block drafter through real servers (gateway -> coordinator -> draft + target
workers over TCP): at T=0 the output is token-identical to Hugging Face greedy `generate` (LM head
in fp32, the hf_reference fixture), as a chain and as a draft tree verified in one forward (from
the table drafted during the previous verify, the default, and drafted just in time), one
request at a time and 4 concurrent; and the drafter earns its keep (acceptance length > 1).
The target runs in float32 here (the session model, see tests/conftest.py's target_model), where
a tree verify, a chain verify, a padded batch and HF's one-token decode agree to ~1e-4 in the
logits, so identity is asserted strictly.

Skipped when the artefact (artifacts/drafters/<model>-block) is not in this checkout.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from draft_worker.block_loader import artefact_dir
from specmesh.config import load_config
from tests.conftest import bf16_hf_mismatch

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not artefact_dir(load_config(environ={}))[0].is_dir(), reason="no block drafter artefact"),
]

MAX_TOKENS = 32
K = 7  # the drafter's block: 8 positions, 7 drafts

PROMPTS = [
    ("code", dict(prompt="Write a Python function that returns the n-th Fibonacci number.")),
    ("list", dict(prompt="List five fruits, one per line.")),
    ("prose", dict(prompt="Write two sentences about the ocean at night.")),
    ("math", dict(prompt="What is 17 * 23? Show your work.")),
]

@pytest.fixture(scope="module")
def references(hf_reference):
    return {label: hf_reference(max_tokens=MAX_TOKENS, **kw) for label, kw in PROMPTS}


def _generate(mesh, kw: dict, tree_budget: int):
    req = mesh.request(max_tokens=MAX_TOKENS, method="block", k=K, temperature=0.0, **kw)
    req.speculation.tree_budget = tree_budget
    return mesh.gateway_stub.Generate(req, timeout=600)


def _run(mesh, tree_budget: int, concurrency: int):
    if concurrency == 1:
        return [_generate(mesh, kw, tree_budget) for _, kw in PROMPTS]
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda item: _generate(mesh, item[1], tree_budget), PROMPTS))


@pytest.mark.parametrize("concurrency", [1, 4])
@pytest.mark.parametrize("tree_budget", [0, 16], ids=["chain", "tree16"])
def test_block_matches_hf_greedy(services, references, target_tokenizer, tree_budget, concurrency):
    mesh = services()
    assert "block" in mesh.drafters, "the draft worker did not load the block drafter"
    responses = _run(mesh, tree_budget, concurrency)
    problems = []
    for (label, kw), resp in zip(PROMPTS, responses):
        why = references[label].explain_mismatch(list(resp.token_ids), target_tokenizer,
                                                 f"[block tree_budget={tree_budget}, concurrency {concurrency}] {label}")
        if why:
            problems.append(why)
        spec = resp.spec
        assert spec.method == "block" and spec.draft_failures == 0, spec
        assert spec.drafted_tokens > 0 and spec.feature_bytes > 0 and spec.draft_feature_bytes > 0, spec
    assert not problems, "\n".join(problems)
    # the drafter earns its keep: more than one token per target step, pooled over the prompts
    rounds = sum(r.spec.rounds for r in responses)
    emitted = sum(r.spec.mean_acceptance_length * r.spec.rounds for r in responses)
    assert rounds > 0 and emitted / rounds > 1.0, [r.spec for r in responses]
    if tree_budget:
        # a tree drafts more nodes than it has positions
        assert sum(r.spec.drafted_tokens for r in responses) > sum(sum(r.spec.drafted_per_position) for r in responses)
        # by default (coordinator.block_tables) a tree comes from the candidate table drafted during
        # the previous verify (coordinator/tails.py), its rows one or more positions stale: most rounds
        # take such a tail (a hit). Whether a table is done
        # by the time the verify returns (draft_waits) is a race between the draft tier's speed and
        # the target's: a benchmark figure ("rounds waited for a draft", docs/bench), not asserted
        # here (session 46: a 1.8x faster target step on a Zen 3 made 50 of 69 fixed-k tree rounds
        # here wait, while the round-policy bench at c1 read 2%)
        spec = [r.spec for r in responses]
        assert sum(s.predraft_hits for s in spec) > sum(s.predraft_misses for s in spec) > 0, spec


@pytest.mark.parametrize("tree_budget", [0, 16], ids=["chain", "tree16"])
def test_block_sampling_runs_clean(services, tree_budget):
    """T > 0: chain drafts carry their warped distributions (rejection sampling), a tree is walked
    by sampling the target (tests/unit/test_tree.py checks both distributions); here: no errors,
    no draft failures, features flowing."""
    mesh = services()
    req = mesh.request(max_tokens=24, method="block", k=K, temperature=0.8, top_p=0.95, seed=11, **PROMPTS[0][1])
    req.speculation.tree_budget = tree_budget
    resp = mesh.gateway_stub.Generate(req, timeout=600)
    assert resp.usage.completion_tokens > 0 and resp.spec.method == "block"
    assert resp.spec.draft_failures == 0 and resp.spec.drafted_tokens > 0 and resp.spec.feature_bytes > 0


def test_block_tree_bf16_matches_the_target_alone_and_hf_greedy(services, target_model_bf16, hf_reference_bf16,
                                                                target_tokenizer):
    """The services' default dtype, 16-node trees, 4 concurrent, from tables (the default) and
    drafted just in time: batch-invariant verification keeps every tree node bitwise on the
    one-token path, so the output is the mesh's own bf16 AR token for token, strictly.

    Against HF bf16 `generate`: strict on a CPU that multiplies bf16 natively. Elsewhere HF's bf16
    arithmetic is emulated by other kernels and its logits are rounded to bf16, while the mesh's
    are float32: a first difference is allowed only where HF's own logits of the two tokens are
    within one bf16 step (measured on an Intel Xeon without avx512_bf16, Ice Lake: a tie at 26.125
    and 24.625 vs 24.5), and is printed."""
    problems = []
    for tables in (True, False):
        mesh = services({"target_worker": {"batch_invariant": True}, "coordinator": {"block_tables": tables}},
                        model=target_model_bf16)
        assert mesh.engine.batch_invariant and "block" in mesh.drafters
        spec = _run(mesh, 16, 4)
        for (label, kw), r in zip(PROMPTS, spec):
            alone = mesh.gateway_stub.Generate(mesh.request(max_tokens=MAX_TOKENS, method="off", k=0, temperature=0.0,
                                                            **kw), timeout=600)
            if list(r.token_ids) != list(alone.token_ids):
                problems.append(f"[bf16 block tree16, tables={tables}] {label}: spec {list(r.token_ids)} "
                                f"!= the target alone {list(alone.token_ids)}")
            why = bf16_hf_mismatch(hf_reference_bf16(max_tokens=MAX_TOKENS, **kw), list(r.token_ids),
                                   target_tokenizer, f"[bf16 vs HF, tables={tables}] {label}")
            if why:
                problems.append(why)
        assert sum(r.spec.accepted_tokens for r in spec) > 0
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("concurrency", [1, 4])
def test_block_tree_drafted_just_in_time_matches_hf_greedy(services, references, target_tokenizer, concurrency):
    """coordinator.block_tables: false: every drafting round waits for a tree drafted from its own
    context's features (the default drafts from the table made during the previous verify, above)."""
    mesh = services({"coordinator": {"block_tables": False}})
    responses = _run(mesh, 8, concurrency)
    problems = [references[label].explain_mismatch(list(r.token_ids), target_tokenizer,
                                                   f"[block just in time, concurrency {concurrency}] {label}")
                for (label, _), r in zip(PROMPTS, responses)]
    assert not [p for p in problems if p], "\n".join(p for p in problems if p)
    spec = [r.spec for r in responses]
    assert all(s.method == "block" and s.draft_failures == 0 and s.predraft_hits == 0 for s in spec), spec
    assert sum(s.accepted_tokens for s in spec) > 0
